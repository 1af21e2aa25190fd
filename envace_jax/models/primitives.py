"""The decoder's stateless numerics: RMSNorm, rotary embeddings, masks and grouped-query
attention. Shared by the stacked decoder (`models.blocks`, `models.decoder`) and the per-layer
`models.layered.LayeredDecoder`, so both compute the same values.

RMSNorm, rotary and softmax run in float32 whatever the compute dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from envace_jax.models.config import ModelConfig


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies [D/2] (float32), with Llama-3 scaling if configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is not None:  # Llama 3.1: stretch long wavelengths, keep short ones, blend between
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = np.where(medium, blended, scaled)
    return inv.astype(np.float32)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """sin, cos [B, T, D/2] float32 for int positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotates x [B, T, N, D] by sin/cos [B, T, D/2] (HF 'rotate_half' layout), in float32."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    s, c = sin[:, :, None, :], cos[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def causal_mask(batch: int, length: int, attention_mask: jax.Array | None) -> jax.Array:
    """bool [B, T, T]: causal by token index, and only onto real keys (attention_mask [B, T])."""
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    if attention_mask is not None:
        mask = mask & (attention_mask[:, None, :] > 0)
    return jnp.broadcast_to(mask, (batch, length, length))


def query_blocks(length: int, block: int) -> list[tuple[int, int]]:
    """(start, end) of the cache-less attention's query blocks: queries [start, end) attend
    to keys [0, end), all that causality lets them see."""
    return [(start, min(start + block, length)) for start in range(0, length, block)]


def attend(qg, keys, values, mask, dt):
    """Grouped-query attention: qg [B, T, K, G, D], keys/values [B, S, K, D], mask bool
    [B, T, S] -> [B, T, K, G, D]. Scores and softmax in float32."""
    D = qg.shape[-1]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32)
    scores = scores * (D**-0.5)
    # A finite fill keeps fully masked rows (left padding's pad queries) NaN-free.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bkgts,bskd->btkgd", probs, values)
