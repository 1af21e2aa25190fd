"""Per-device memory of a training job, from its config and a mesh, without allocating anything.

Two phases of a run hold the most memory at once:

* **train step** (the warm start's SFT step and the RL phase's GRPO step, whichever is larger):
  the train state (parameters and AdamW moments, donated and updated in place), the float32
  gradient accumulator, the step's batch, and the activations of one micro-batch: with
  rematerialisation ('full') the input of every layer is saved and one layer at a time is
  recomputed in the backward pass, so the peak is the saved layer inputs plus the larger of one
  layer's working set (dominated by the [T, T] attention scores, float32: the decoder has no
  blockwise attention) and the logits' working set ([T, V] float32: log-softmax, entropy and
  their gradients);
* **sampling** (rollouts and evaluation): the train state stays resident while the sampler's
  KV cache [L, B, S, K, D] for all rows, its token buffers, and the prompt prefill's working set
  are live.

Every array is split the way the code splits it: parameter shapes and logical axes come from
`models.decoder.param_paths`, mesh axes from `parallel.logical_to_spec` with the default rules,
so a dimension that does not divide its mesh axes is counted whole, as it is placed.

The working-set multipliers (how many score- or logit-sized buffers XLA keeps live at the peak)
were measured from the compiled steps' memory analysis on CPU (`tests/test_plan.py` checks the
estimate against measured allocations of small configs); TPU fusion usually needs fewer
buffers, so the estimate errs on the safe side.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax.numpy as jnp
import ml_collections
from jax.sharding import AbstractMesh, AxisType

from envace_jax.models.config import ModelConfig, get_preset
from envace_jax.models.decoder import CACHE_LOGICAL_AXES, param_paths
from envace_jax.models.shipped import resolve_hf_path
from envace_jax.parallel import DEFAULT_RULES, MESH_AXES, logical_to_spec
from envace_jax.rl.config import GRPOConfig, SFTConfig
from envace_jax.sampling.sampler import pow2_bucket

# How many buffers of each size XLA keeps live at the peak, fitted to the compiled steps' memory
# analysis on CPU over 39 small configs (all remat policies, float32 and bfloat16 compute,
# data / fsdp / tensor meshes); the fit is within 16% on every one of them.
GRAD_BUFFERS = 1.6  # parameter-sized float32: the accumulator and the micro-batch gradient
GATHERED_BUFFERS = 1.3  # FSDP: one layer's all-gathered weights (+ embedding and head) and grads
BATCH_BUFFERS = 2.0  # [B, T] float32 per-token arrays of the step (advantages, masks, weights)
ATTENTION_BUFFERS = 4.0  # [b, H, T, T] float32 scores while one layer is recomputed
LAYER_BUFFERS = 3.8  # [b, T, E + F + (H + 2K) D] float32: one layer's projections and MLP
NO_REMAT_ATTENTION = 3.95  # remat='none': score-sized buffers saved per layer
NO_REMAT_LAYER = 0.62  # remat='none': projection-sized buffers saved per layer
DOTS_SAVED = 0.77  # remat='dots': saved projection outputs (q, k, v, o, gate, up, down)
LOGIT_BUFFERS = 3.9  # [b, T, V] float32 around the log-softmax, entropy and their gradient
LOGIT_BUFFERS_TP = 5.05  # the same with the vocabulary split over 'tensor' (resharding copies)
# [b, H, P, P] float32 of the prompt prefill's attention: a fresh prefill attends to the
# call's own keys (`Decoder.prefill`), not to every slot of the buffer. XLA's temp size of the
# compiled prefill (tiny-qwen3, P 1,024-2,048, S 4,096-8,192, 4-8 rows) is 0.96-1.12 of
# b * H * P * P * 4 bytes, whatever S.
PREFILL_BUFFERS = 1.15
DECODE_BUFFERS = 1.6  # one layer's keys and values, read per decode step
BATCH_BYTES_PER_SLOT = 13  # int32 token + int8 role + int32 segment + float32 logprob


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A ('data', 'fsdp', 'tensor') mesh of the given sizes with no devices behind it."""
    shape = tuple(int(sizes[a]) for a in MESH_AXES)
    return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _shard(shape, axes, mesh, rules=DEFAULT_RULES) -> tuple[int, ...]:
    """The per-device block of an array of `shape` with logical `axes` (ceil division)."""
    spec = logical_to_spec(axes, mesh, rules, shape)
    sizes = dict(mesh.shape)
    out = []
    for n, s in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = () if s is None else (s,) if isinstance(s, str) else tuple(s)
        out.append(-(-n // math.prod(sizes[a] for a in names)))
    return tuple(out)


def _split(n: int, axis: str, mesh) -> int:
    """Per-device size of one activation dimension of size n with logical `axis`."""
    return _shard((n,), (axis,), mesh)[0]


def _nbytes(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


@dataclasses.dataclass
class Line:
    """One component. kind: 'state' (train state arrays, resident across phases), 'input' (the
    phase's own arguments), 'temp' (the compiled program's working memory)."""

    name: str
    bytes: float
    kind: str
    note: str = ""


@dataclasses.dataclass
class Phase:
    """Per-device bytes of one phase of the job; `shapes` says what they were computed from."""

    name: str
    lines: list[Line]
    shapes: dict[str, Any]

    @property
    def total(self) -> float:
        return sum(line.bytes for line in self.lines)

    def of_kind(self, kind: str) -> float:
        return sum(line.bytes for line in self.lines if line.kind == kind)


def param_count_per_device(cfg: ModelConfig, mesh) -> int:
    """Parameters each device holds, split by their logical axes."""
    return sum(math.prod(_shard(s, a, mesh)) for s, a in param_paths(cfg).values())


def _gathered_weights(cfg: ModelConfig, mesh) -> int:
    """Elements of one layer's weights plus the embedding and head, split over 'tensor' only
    (what FSDP all-gathers for the layer being computed)."""
    tp = abstract_mesh({"data": 1, "fsdp": 1, "tensor": dict(mesh.shape)["tensor"]})
    per_layer = 0
    for path, (shape, axes) in param_paths(cfg).items():
        if path.startswith("layers."):
            per_layer += math.prod(_shard(shape[1:], axes[1:], tp))
    heads = sum(
        math.prod(_shard(shape, axes, tp))
        for path, (shape, axes) in param_paths(cfg).items()
        if path in ("embed.embedding", "lm_head.kernel")
    )
    return per_layer + heads


def state_lines(cfg: ModelConfig, mesh, *, use_kl: bool = False) -> list[Line]:
    """The arrays a training run keeps on device throughout."""
    p = param_count_per_device(cfg, mesh) * _nbytes(cfg.param_dtype)
    lines = [
        Line("parameters", p, "state", cfg.param_dtype),
        Line("optimizer state", 2 * p, "state", f"AdamW moments, {cfg.param_dtype}"),
        Line("initial parameters", p, "state", "still held by the model the trainer built"),
    ]
    if use_kl:
        lines.append(Line("KL reference parameters", p, "state", "frozen copy"))
    return lines


def train_step_phase(
    cfg: ModelConfig,
    mesh,
    *,
    rows: int,
    length: int,
    mini: int,
    micro: int,
    name: str,
    state: list[Line] | None = None,
) -> Phase:
    """One train step on `rows` x `length` batches, cut into mini x micro chunks."""
    dt = _nbytes(cfg.dtype)
    chunk_rows = max(rows // (mini * micro), 1)
    b = _split(chunk_rows, "batch", mesh)  # rows per device in one micro-batch
    batch_dev = _split(rows, "batch", mesh)
    T, E, L, D = length, cfg.hidden_size, cfg.num_layers, cfg.head_dim
    H = _split(cfg.num_heads, "act_heads", mesh)
    K = _split(cfg.num_kv_heads, "act_kv_heads", mesh)
    F = _split(cfg.intermediate_size, "act_mlp", mesh)
    V = _split(cfg.vocab_size, "act_vocab", mesh)
    sizes = dict(mesh.shape)

    lines = list(state if state is not None else state_lines(cfg, mesh))
    lines.append(Line("batch", BATCH_BYTES_PER_SLOT * batch_dev * T, "input", f"{batch_dev} rows"))
    grads = GRAD_BUFFERS * param_count_per_device(cfg, mesh) * 4
    lines.append(Line("gradients", grads, "temp", "float32 accumulator and micro-batch gradient"))
    if sizes["fsdp"] > 1:
        gathered = GATHERED_BUFFERS * _gathered_weights(cfg, mesh) * dt
        lines.append(Line("gathered weights", gathered, "temp", "FSDP all-gather of one layer"))
    lines.append(Line("per-token arrays", BATCH_BUFFERS * batch_dev * T * 4, "temp", ""))

    scores = b * H * T * T * 4
    proj = b * T * (E + F + (H + 2 * K) * D)
    layer = ATTENTION_BUFFERS * scores + LAYER_BUFFERS * proj * 4
    logits = (LOGIT_BUFFERS if V == cfg.vocab_size else LOGIT_BUFFERS_TP) * b * T * V * 4
    if cfg.remat == "full":
        saved, note = L * b * T * E * dt, "remat=full: each layer's input"
    elif cfg.remat == "dots":
        dots = b * T * ((H + 2 * K) * D + 2 * E + 2 * F)  # q k v, o, gate up, down outputs
        saved = L * b * T * E * dt + DOTS_SAVED * L * dots * dt
        note = "remat=dots: each layer's input and projection outputs"
    else:
        saved = L * (NO_REMAT_ATTENTION * scores + NO_REMAT_LAYER * proj * 4)
        note = "remat=none: every layer's activations"
        layer = 0.0
    lines.append(Line("activations: saved", saved, "temp", note))
    if layer >= logits:
        lines.append(Line("activations: working set", layer, "temp", "attention scores [T, T] f32"))
    else:
        lines.append(Line("activations: working set", logits, "temp", "logits [T, V] f32"))
    shapes = dict(rows=rows, length=T, micro_batch_rows=chunk_rows, rows_per_device=b, heads=H)
    return Phase(name, lines, shapes)


def sampler_phase(
    cfg: ModelConfig,
    mesh,
    *,
    rows: int,
    prompt: int,
    new_tokens: int,
    name: str,
    state: list[Line] | None = None,
) -> Phase:
    """The sampler on `rows` prompts of up to `prompt` tokens with `new_tokens` more each, with
    the train state resident. Buffers are the sampler's power-of-two buckets."""
    P = pow2_bucket(prompt)
    S = pow2_bucket(prompt + new_tokens)
    L, D = cfg.num_layers, cfg.head_dim
    cache_shape = (L, rows, S, cfg.num_kv_heads, D)
    cache = 2 * math.prod(_shard(cache_shape, CACHE_LOGICAL_AXES, mesh)) * _nbytes(cfg.dtype)
    b = _split(rows, "batch", mesh)
    H = _split(cfg.num_heads, "act_heads", mesh)
    prefill = PREFILL_BUFFERS * b * H * P * P * 4
    decode = DECODE_BUFFERS * cache / L
    lines = list(state if state is not None else state_lines(cfg, mesh))
    lines += [
        Line("KV cache", cache, "input", f"{rows} rows x {S} slots, {cfg.dtype}"),
        Line("token buffers", BATCH_BYTES_PER_SLOT * b * S, "input", f"{b} rows x {S} slots"),
        Line(
            "working set",
            max(prefill, decode),
            "temp",
            f"prefill attention over a {P}-token prompt" if prefill >= decode else "decode step",
        ),
    ]
    return Phase(name, lines, dict(rows=rows, rows_per_device=b, slots=S, prompt_bucket=P))


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The policy's architecture as `build.build_model` will make it: the HF checkpoint's
    config.json when the checkpoint is on this machine, else the preset with the tokenizer's
    vocabulary (when the tokenizer is here; else the preset's own)."""
    m = config.model
    numerics = dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat)
    path = resolve_hf_path(m.hf_path)
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return ModelConfig.from_hf(path, **numerics)
    if config.tokenizer == "demo" or os.path.isdir(config.tokenizer):
        from envace_jax.text.tokenizer import load_tokenizer

        numerics["vocab_size"] = len(load_tokenizer(config.tokenizer))
    return get_preset(m.preset, **numerics)


def plan_phases(
    config: ml_collections.ConfigDict,
    cfg: ModelConfig,
    mesh,
    *,
    prompt_tokens: int | None = None,
) -> list[Phase]:
    """Every phase the job `config` runs: warm-start step, RL step, rollouts, evaluation.

    prompt_tokens: the longest prompt (default: the longest that still leaves room for
    rollout.max_new_tokens inside the largest length bucket).
    """
    r, s = config.rollout, config.schedule
    longest = max(r.length_buckets)
    if prompt_tokens is None:
        prompt_tokens = max(1, longest - r.max_new_tokens)
    sft = SFTConfig.from_config(config.sft, "sft")
    grpo = GRPOConfig.from_config(config.grpo, "grpo")
    state = state_lines(cfg, mesh, use_kl=grpo.use_kl)
    rl_rows = r.group_size * r.tasks_per_step
    phases = []
    if s.sft_steps:
        phases.append(
            train_step_phase(
                cfg,
                mesh,
                rows=s.sft_batch_size,
                length=longest,
                mini=sft.mini_batches,
                micro=sft.micro_batches,
                name="warm-start step",
                state=state,
            )
        )
    if s.rl_steps:
        phases.append(
            train_step_phase(
                cfg,
                mesh,
                rows=rl_rows,
                length=longest,
                mini=grpo.mini_batches,
                micro=grpo.micro_batches,
                name="RL step",
                state=state,
            )
        )
        phases.append(
            sampler_phase(
                cfg,
                mesh,
                rows=rl_rows,
                prompt=prompt_tokens,
                new_tokens=r.max_new_tokens,
                name="rollouts",
                state=state,
            )
        )
    phases.append(
        sampler_phase(
            cfg,
            mesh,
            rows=config.data.eval_tasks,
            prompt=prompt_tokens,
            new_tokens=config.eval.max_new_tokens,
            name="evaluation",
            state=state,
        )
    )
    return phases
