"""Next-token choice: greedy, temperature, top-k and top-p, with training-grade log-probs.

Parameters come in two forms. `SamplingParams` holds one setting for the whole batch as
program constants (a static jit argument: the cheapest program, one per setting). `RowSampling`
holds one setting per row as arrays, so rows with different settings share one batch and one
compiled program (the serving engine, where every client picks its own).

The log-prob returned for a sampled token is taken under the *untruncated* temperature-scaled
distribution, log softmax(logits / T), not under the top-k/top-p renormalised one: the trainer
recomputes log-probs with a plain softmax, so truncation would bias the importance ratios.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Frozen and hashable: a static argument of jitted code.

    temperature: > 0; ignored when greedy.
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 keeps all.
    greedy: argmax (log-probs are then those of temperature 1).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self):
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@struct.dataclass
class RowSampling:
    """One `SamplingParams` per row, as arrays [B] (values of the program, not constants)."""

    temperature: jax.Array  # float32; 1 where greedy
    top_k: jax.Array  # int32; 0 keeps all
    top_p: jax.Array  # float32; 1 keeps all
    greedy: jax.Array  # bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> RowSampling:
        """Host arrays of the rows' settings, in row order."""
        return cls(
            temperature=np.array([1.0 if p.greedy else p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            greedy=np.array([p.greedy for p in params], np.bool_),
        )


def truncate_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Masks logits [B, V] outside the top-k / top-p support to -inf (static k, p)."""
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, _NEG_INF, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Mass strictly before each sorted token; a token is kept while that mass < top_p,
        # so the most likely token is always kept.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = mass_before < top_p
        threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, _NEG_INF, logits)
    return logits


def truncate_rows(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`truncate_logits` with a k [B] and a p [B] per row: the same support, from one sort."""
    V = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    # Sorted, the tokens top-k masks are the tail: masking there keeps the order, so the
    # top-p mass below is that of the top-k-masked logits, as in `truncate_logits`.
    sorted_logits = jnp.where(sorted_logits < kth, _NEG_INF, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < jnp.maximum(threshold, kth), _NEG_INF, logits)


def sample_next(
    logits: jax.Array, key: jax.Array, params: SamplingParams | RowSampling
) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row. logits: f32 [B, V]. Returns (tokens int32 [B], logprobs f32 [B])."""
    logits = logits.astype(jnp.float32)
    if isinstance(params, RowSampling):
        return _sample_rows(logits, key, params)
    temperature = 1.0 if params.greedy else params.temperature
    scaled = logits / temperature
    logprobs_all = jax.nn.log_softmax(scaled, axis=-1)
    if params.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        tokens = jax.random.categorical(key, truncate_logits(scaled, params.top_k, params.top_p))
    tokens = tokens.astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen


def _sample_rows(logits: jax.Array, key: jax.Array, p: RowSampling) -> tuple[jax.Array, jax.Array]:
    scaled = logits / jnp.where(p.greedy, 1.0, p.temperature)[:, None]
    logprobs_all = jax.nn.log_softmax(scaled, axis=-1)
    V = logits.shape[-1]
    truncates = ~p.greedy & (((p.top_k > 0) & (p.top_k < V)) | (p.top_p < 1.0))
    # The sort costs more than the rest of a small model's step: skipped when no row needs it.
    support = jax.lax.cond(
        jnp.any(truncates),
        lambda: truncate_rows(scaled, p.top_k, p.top_p),
        lambda: scaled,
    )
    sampled = jax.random.categorical(key, support)
    tokens = jnp.where(p.greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    chosen = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen
