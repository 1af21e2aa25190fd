"""Next-token choice: greedy, temperature, top-k and top-p, with training-grade log-probs.

The log-prob returned for a sampled token is taken under the *untruncated* temperature-scaled
distribution, log softmax(logits / T), not under the top-k/top-p renormalised one: the trainer
recomputes log-probs with a plain softmax, so truncation would bias the importance ratios.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

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


def sample_next(
    logits: jax.Array, key: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row. logits: f32 [B, V]. Returns (tokens int32 [B], logprobs f32 [B])."""
    logits = logits.astype(jnp.float32)
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
