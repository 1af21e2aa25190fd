"""Decoder configuration for the Qwen3 and Llama families, HF `config.json` conversion, presets.

`ModelConfig` is a frozen dataclass (hashable, so it can be a static argument under jit).
`ModelConfig.from_hf` reads a Hugging Face config (dict, `config.json` path, or a model
directory) in either the transformers v4 layout (`rope_theta`, `rope_scaling`,
`torch_dtype`) or the v5 layout (`rope_parameters`, `dtype`), and rejects features the
decoder does not implement with a `ValueError` naming the config key. `to_hf` writes a dict
that `transformers.AutoConfig.for_model(**d)` / `from_pretrained` loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# Per family (HF `model_type`): its HF architecture name and whether it has q/k RMSNorm.
_FAMILY_KEYS = {
    "qwen3": {"architecture": "Qwen3ForCausalLM", "qk_norm": True},
    "llama": {"architecture": "LlamaForCausalLM", "qk_norm": False},
}
FAMILIES = tuple(_FAMILY_KEYS)
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# HF keys every config must have.
_HF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
# HF features the decoder does not implement: (key, default, supported(value), why).
_HF_UNSUPPORTED = (
    ("hidden_act", "silu", lambda v: v == "silu", "only 'silu' (SwiGLU) is implemented"),
    (
        "attention_bias",
        False,
        lambda v: not v,
        "attention projections with bias are not implemented",
    ),
    ("mlp_bias", False, lambda v: not v, "MLP projections with bias are not implemented"),
    ("pretraining_tp", 1, lambda v: v == 1, "only 1 is supported"),
    ("use_sliding_window", False, lambda v: not v, "sliding-window attention is not implemented"),
    (
        "layer_types",
        None,
        lambda v: all(t == "full_attention" for t in v or ()),
        "only 'full_attention' layers are implemented",
    ),
    *(
        (key, None, lambda v: not v, "mixture-of-experts layers are not implemented")
        for key in ("num_experts", "num_local_experts", "n_routed_experts")
    ),
)
# ModelConfig field <- (HF key, default, conversion); the fields HF spells the same way, or
# renames, and that need no other key to read.
_HF_FIELDS = {
    "vocab_size": ("vocab_size", None, None),
    "hidden_size": ("hidden_size", None, None),
    "intermediate_size": ("intermediate_size", None, None),
    "num_layers": ("num_hidden_layers", None, None),
    "rms_norm_eps": ("rms_norm_eps", 1e-6, float),
    "tie_word_embeddings": ("tie_word_embeddings", False, bool),
    "max_position_embeddings": ("max_position_embeddings", 4096, None),
    "bos_token_id": ("bos_token_id", None, None),
    "eos_token_id": ("eos_token_id", None, lambda v: tuple(v) if isinstance(v, list) else v),
    "pad_token_id": ("pad_token_id", None, None),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of one decoder.

    Sizes: V vocab_size, E hidden_size, F intermediate_size, L num_layers, H num_heads,
    K num_kv_heads, D head_dim (independent of E / H, as in Qwen3).
    """

    family: str = "qwen3"  # 'qwen3' (q/k RMSNorm) or 'llama'
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    # None, or HF's Llama-3 format: {'rope_type': 'llama3', 'factor', 'low_freq_factor',
    # 'high_freq_factor', 'original_max_position_embeddings'}. Treat as read-only: the
    # config hashes it (configs are static arguments under jit).
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = True  # per-head RMSNorm on q and k (Qwen3)
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"  # storage dtype of the parameters
    dtype: str = "float32"  # compute dtype (softmax and norms always run in float32)
    remat: str = "none"  # per-layer jax.checkpoint policy: 'none' | 'full' | 'dots'
    scan_layers: bool = True  # lax.scan over the stacked layers (else a Python loop)
    # Cache-less attention runs in blocks of this many queries, each skipping the keys past
    # its last query (a long sequence then computes about half the causal score matrix).
    query_block: int = 256
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.rope_scaling is not None:  # private copy, so callers cannot mutate ours
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    def __hash__(self):  # the dataclass hash would fail on the rope_scaling dict
        vals = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in vals))

    # ------------------------------------------------------------------ views
    @property
    def num_params(self) -> int:
        """Number of parameters (tied embeddings counted once)."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        h, k = self.num_heads, self.num_kv_heads
        per_layer = 2 * e + e * d * (2 * h + 2 * k) + 3 * e * f + (2 * d if self.qk_norm else 0)
        lm_head = 0 if self.tie_word_embeddings else e * self.vocab_size
        return self.vocab_size * e + self.num_layers * per_layer + e + lm_head

    def replace(self, **overrides) -> ModelConfig:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"ModelConfig has no field(s) {unknown}")
        return dataclasses.replace(self, **overrides)

    # ------------------------------------------------------------- validation
    def validate(self) -> ModelConfig:
        """Raises ValueError naming the offending field; returns self for chaining."""

        def bad(field, why):
            raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        if self.family not in FAMILIES:
            bad("family", f"must be one of {FAMILIES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
            "query_block",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(name, "must be a positive int")
        if self.num_heads % self.num_kv_heads:
            bad("num_heads", f"must be divisible by num_kv_heads={self.num_kv_heads} (GQA)")
        if self.head_dim % 2:
            bad("head_dim", "must be even (rotary embedding rotates pairs)")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            bad("rope_theta", "must be a positive finite number")
        if not (0 < self.rms_norm_eps < 1):
            bad("rms_norm_eps", "must be in (0, 1)")
        if self.param_dtype not in DTYPES:
            bad("param_dtype", f"must be one of {DTYPES}")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}")
        if self.remat not in REMAT_POLICIES:
            bad("remat", f"must be one of {REMAT_POLICIES}")
        if self.family == "qwen3" and not self.qk_norm:
            bad("qk_norm", "Qwen3 always normalises q and k; set qk_norm=True")
        rs = self.rope_scaling
        if rs is not None and not isinstance(rs, dict):
            bad("rope_scaling", "must be None or a dict")
        if rs is not None:
            if rs.get("rope_type") != "llama3":
                bad("rope_scaling", "only rope_type 'llama3' is supported")
            missing = [k for k in _LLAMA3_KEYS if k not in rs]
            if missing:
                bad("rope_scaling", f"llama3 scaling needs keys {missing}")
            if not rs["high_freq_factor"] > rs["low_freq_factor"] > 0:
                bad("rope_scaling", "needs high_freq_factor > low_freq_factor > 0")
            if not rs["factor"] > 0 or not rs["original_max_position_embeddings"] > 0:
                bad("rope_scaling", "factor and original_max_position_embeddings must be > 0")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                bad(name, f"must be in [0, vocab_size={self.vocab_size})")
        eos = self.eos_token_id
        for v in () if eos is None else (eos if isinstance(eos, tuple) else (eos,)):
            if not 0 <= v < self.vocab_size:
                bad("eos_token_id", f"must be in [0, vocab_size={self.vocab_size})")
        return self

    # ------------------------------------------------------------ HF <-> ours
    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike, **overrides) -> ModelConfig:
        """Builds a config from a HF `config.json` (dict, file path, or model directory).

        `overrides` set fields HF does not describe (param_dtype, dtype, remat, scan_layers)
        or replace read ones; the checkpoint's own dtype is not used (param_dtype and dtype
        default to float32). Unsupported features raise ValueError naming the key.
        """
        c, source = _read_hf_config(config)

        def fail(key, why):
            raise ValueError(f"{source}: unsupported {key}={c.get(key)!r}: {why}")

        family = _hf_family(c, source, fail)
        rope_theta, rope_scaling = _hf_rope(c, fail)
        heads = c.get("num_attention_heads")
        if not heads:
            raise ValueError(f"{source}: missing required key 'num_attention_heads'")
        fields = {
            field: c.get(key, default) if convert is None else convert(c.get(key, default))
            for field, (key, default, convert) in _HF_FIELDS.items()
        }
        fields.update(
            family=family,
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qk_norm=_FAMILY_KEYS[family]["qk_norm"],
        )
        fields.update(overrides)
        try:
            return cls(**fields).validate()
        except TypeError as e:  # unknown override name
            raise ValueError(f"ModelConfig.from_hf: {e}") from e

    def to_hf(self) -> dict[str, Any]:
        """A HF `config.json` dict (v5 keys plus the v4 aliases, so either version loads it)."""
        self.validate()
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        eos = self.eos_token_id
        d = {
            "architectures": [_FAMILY_KEYS[self.family]["architecture"]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_parameters": rope_parameters,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
            "pad_token_id": self.pad_token_id,
            "dtype": self.param_dtype,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.family == "qwen3":
            d.update(use_sliding_window=False, sliding_window=None)
        else:
            d.update(mlp_bias=False, pretraining_tp=1)
        return d


def _read_hf_config(config: dict | str | os.PathLike) -> tuple[dict, str]:
    """The HF config as a dict, and how errors name its source."""
    if isinstance(config, dict):
        return dict(config), "config dict"
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f)), path
    except FileNotFoundError as e:
        raise ValueError(f"HF config not found: {path}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _hf_family(c: dict, source: str, fail) -> str:
    """The config's family, once its architecture, required keys and features are supported."""
    family = c.get("model_type")
    if family not in FAMILIES:
        fail("model_type", f"supported model types are {FAMILIES}")
    architecture = _FAMILY_KEYS[family]["architecture"]
    archs = c.get("architectures") or [architecture]
    if list(archs) != [architecture]:
        fail("architectures", f"expected [{architecture!r}]")
    for key in _HF_REQUIRED:
        if key not in c:
            raise ValueError(f"{source}: missing required key {key!r}")
    for key, default, supported, why in _HF_UNSUPPORTED:
        if not supported(c.get(key, default)):
            fail(key, why)
    return family


def _hf_rope(c: dict, fail) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling). v5 keeps everything in `rope_parameters`; v4 uses
    rope_theta + rope_scaling."""
    rope_params = dict(c.get("rope_parameters") or {})
    legacy = c.get("rope_scaling") or {}
    if not isinstance(rope_params, dict) or not isinstance(legacy, dict):
        fail("rope_parameters", "expected a dict (per-layer-type rope is not supported)")
    rope = {**legacy, **rope_params}
    theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope_key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        fail("partial_rotary_factor", "partial rotary embeddings are not implemented")
    rope.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        fail(rope_key, f"rope_type {rope_type!r} is not supported (only 'default', 'llama3')")
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        fail(rope_key, f"llama3 rope scaling is missing {missing}")
    return float(theta), {"rope_type": "llama3", **{k: rope[k] for k in _LLAMA3_KEYS}}


def _preset(
    family: str,
    sizes: tuple[int, int, int, int, int, int, int],
    *,
    rope_theta: float,
    eps: float,
    tied: bool,
    max_len: int,
    **token_ids: int,
) -> ModelConfig:
    """A `family` decoder of sizes (V, E, F, L, H, K, D) (the `ModelConfig` docstring's names),
    RMSNorm `eps`, embeddings `tied` or not, `max_len` positions and the given bos/eos/pad
    token ids; q/k RMSNorm as the family has it."""
    V, E, F, L, H, K, D = sizes
    return ModelConfig(
        family=family,
        vocab_size=V,
        hidden_size=E,
        intermediate_size=F,
        num_layers=L,
        num_heads=H,
        num_kv_heads=K,
        head_dim=D,
        rope_theta=rope_theta,
        rms_norm_eps=eps,
        tie_word_embeddings=tied,
        qk_norm=_FAMILY_KEYS[family]["qk_norm"],
        max_position_embeddings=max_len,
        **token_ids,
    )


def _qwen3(*, hidden: int, mlp: int, layers: int, heads: int, tied: bool) -> ModelConfig:
    """A Qwen3 dense model: 8 KV heads of 128 dims, 151936-token vocabulary, rope theta 1e6."""
    sizes = (151936, hidden, mlp, layers, heads, 8, 128)
    ids = {"bos_token_id": 151643, "eos_token_id": 151645}
    return _preset("qwen3", sizes, rope_theta=1e6, eps=1e-6, tied=tied, max_len=40960, **ids)


# Presets. Sizes of the tests' tiny model are deliberately non-default (head_dim != E / H,
# rope theta, eps) so that a loader or port that ignores one of them fails parity.
PRESETS: dict[str, ModelConfig] = {
    "tiny-qwen3": _preset(
        "qwen3", (512, 64, 96, 2, 4, 2, 24), rope_theta=5e5, eps=1e-5, tied=False, max_len=512
    ),
    # About 1M parameters with a 2048-token vocabulary: trains on a 2-core CPU in minutes. The
    # vocab size is replaced by the demo tokenizer's at use time.
    "demo-qwen3": _preset(
        "qwen3", (2048, 128, 384, 4, 4, 2, 32), rope_theta=1e6, eps=1e-6, tied=True, max_len=4096
    ),
    # Qwen/Qwen3-1.7B, -4B, -8B (the paper's policies): the architectures their HF config.json
    # files describe, for planning and random-init runs; training loads the checkpoint itself.
    "qwen3-1.7b": _qwen3(hidden=2048, mlp=6144, layers=28, heads=16, tied=True),
    "qwen3-4b": _qwen3(hidden=2560, mlp=9728, layers=36, heads=32, tied=True),
    "qwen3-8b": _qwen3(hidden=4096, mlp=12288, layers=36, heads=32, tied=False),
    # HuggingFaceTB/SmolLM2-135M-Instruct.
    "smollm2-135m": _preset(
        "llama",
        (49152, 576, 1536, 30, 9, 3, 64),
        rope_theta=100000.0,
        eps=1e-5,
        tied=True,
        max_len=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name with fields replaced by `overrides`, validated."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides).validate()
