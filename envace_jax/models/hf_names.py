"""How each decoder parameter maps to Hugging Face tensors: names and layouts.

Parameter layout (ours <- HF). Kernels are transposed relative to torch `Linear.weight`
(`[out, in]`) and attention heads are split out:

    embed.embedding             [V, E]        <- model.embed_tokens.weight [V, E]
    layers.attn.q_proj.kernel   [L, E, H, D]  <- model.layers.{i}.self_attn.q_proj.weight [H*D, E]
    layers.attn.o_proj.kernel   [L, H, D, E]  <- model.layers.{i}.self_attn.o_proj.weight [E, H*D]
    layers.mlp.down_proj.kernel [L, F, E]     <- model.layers.{i}.mlp.down_proj.weight [E, F]
    lm_head.kernel              [E, V]        <- lm_head.weight [V, E]   (untied models only)

(the full table is `RULES` below). Which entries a model has (Qwen3's q/k norms, an untied
head) is read off the abstract model, so one table serves both families.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one of our params maps to HF tensors.

    hf: the HF tensor name; `{i}` marks per-layer tensors, stacked on our leading axis.
    n_in: for kernels, how many leading (input) dims the per-layer param has; the HF weight is
      then `[prod(out dims), prod(in dims)]`. None: same layout on both sides.
    """

    hf: str
    n_in: int | None = None

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    def hf_shape(self, layer_shape: tuple[int, ...]) -> tuple[int, ...]:
        """HF tensor shape for one layer of a param whose per-layer shape is `layer_shape`."""
        if self.n_in is None:
            return tuple(layer_shape)
        return (math.prod(layer_shape[self.n_in :]), math.prod(layer_shape[: self.n_in]))

    def layer_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape[1:]) if self.stacked else tuple(shape)

    def num_layers(self, shape: tuple[int, ...]) -> int:
        return shape[0] if self.stacked else 1

    def name(self, layer: int) -> str:
        return self.hf.format(i=layer) if self.stacked else self.hf

    def to_hf(self, p: np.ndarray) -> np.ndarray:
        """One layer of our param -> the HF tensor (contiguous, ready to write)."""
        if self.n_in is None:
            return np.ascontiguousarray(p)
        n_in = math.prod(p.shape[: self.n_in])
        return np.ascontiguousarray(p.reshape(n_in, -1).T)


_L = "model.layers.{i}."
RULES: dict[str, Rule] = {
    "embed.embedding": Rule("model.embed_tokens.weight"),
    "layers.attn_norm.scale": Rule(_L + "input_layernorm.weight"),
    "layers.attn.q_proj.kernel": Rule(_L + "self_attn.q_proj.weight", 1),
    "layers.attn.k_proj.kernel": Rule(_L + "self_attn.k_proj.weight", 1),
    "layers.attn.v_proj.kernel": Rule(_L + "self_attn.v_proj.weight", 1),
    "layers.attn.o_proj.kernel": Rule(_L + "self_attn.o_proj.weight", 2),
    "layers.attn.q_norm.scale": Rule(_L + "self_attn.q_norm.weight"),
    "layers.attn.k_norm.scale": Rule(_L + "self_attn.k_norm.weight"),
    "layers.mlp_norm.scale": Rule(_L + "post_attention_layernorm.weight"),
    "layers.mlp.gate_proj.kernel": Rule(_L + "mlp.gate_proj.weight", 1),
    "layers.mlp.up_proj.kernel": Rule(_L + "mlp.up_proj.weight", 1),
    "layers.mlp.down_proj.kernel": Rule(_L + "mlp.down_proj.weight", 1),
    "final_norm.scale": Rule("model.norm.weight"),
    "lm_head.kernel": Rule("lm_head.weight", 1),
}

# Tensors some HF checkpoints carry that are not parameters of any model we build: old Llama
# exports store the RoPE inverse frequencies; tied models may still store the head.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
TIED_HEAD = "lm_head.weight"


def rule_for(path: str) -> Rule:
    try:
        return RULES[path]
    except KeyError:
        raise ValueError(
            f"parameter {path!r} has no Hugging Face name; known parameters: {sorted(RULES)}"
        ) from None
