"""Per-token policy losses and their aggregation weights.

Aggregation is expressed as per-token weights that sum to one over a mini-batch, computed once
from the masks before the mini-batch is cut into micro-batches. The loss of a micro-batch is
then `sum(weights * per_token_loss)`, and the sum over micro-batches equals the loss of the
whole mini-batch exactly, whatever the aggregation mode.

Modes:
  message-mean: mean over each message's tokens, then mean over messages (default). This is
    what the reference's one-row-per-message, micro-batch-1 trainer optimises.
  token-mean: one mean over all trained tokens.
  seq-mean-token-mean: mean over each trajectory row's tokens, then mean over rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from envace_jax.rl.config import GRPOConfig


def token_weights(mask: jax.Array, segments: jax.Array, mode: str) -> jax.Array:
    """[B, T] f32 weights, zero off `mask`, summing to 1 when any token is trained.

    Args:
      mask: [B, T] bool, trained tokens.
      segments: [B, T] int, message id per token (only read for 'message-mean').
      mode: 'message-mean', 'token-mean' or 'seq-mean-token-mean'.
    """
    m = mask.astype(jnp.float32)
    if mode == "token-mean":
        return m / jnp.maximum(m.sum(), 1.0)
    if mode == "seq-mean-token-mean":
        per_row = m.sum(axis=1, keepdims=True)
        rows = (per_row > 0).sum()
        return m / jnp.maximum(per_row, 1.0) / jnp.maximum(rows, 1)
    if mode == "message-mean":
        b, t = segments.shape
        slots = t + 1
        flat = jnp.arange(b, dtype=jnp.int32)[:, None] * slots + segments.astype(jnp.int32)
        per_msg = jax.ops.segment_sum(m.ravel(), flat.ravel(), b * slots)
        n_msgs = (per_msg > 0).sum()
        return m / jnp.maximum(per_msg[flat], 1.0) / jnp.maximum(n_msgs, 1)
    raise ValueError(
        f"loss aggregation {mode!r}: expected message-mean, token-mean or seq-mean-token-mean"
    )


def k3_kl(logp: jax.Array, ref_logp: jax.Array, clamp: float) -> jax.Array:
    """Low-variance KL estimate exp(q - p) - (q - p) - 1 with q = ref, clamped to [-c, c]."""
    d = jnp.clip(ref_logp - logp, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -clamp, clamp)


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    mask: jax.Array,
    cfg: GRPOConfig,
    *,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped (dual-clip) PPO loss with optional k3 KL and entropy terms.

    Args:
      logp, old_logp, advantages, weights: [B, T] f32 (token log-probs under the current and
        sampling/old policy, token advantages, aggregation weights from `token_weights`).
      mask: [B, T] bool, trained tokens (statistics are taken over them).
      cfg: clip_low/high, dual_clip, log_ratio_clamp, use_kl/kl_coef/kl_clamp, entropy_coef.
      ref_logp: [B, T] f32, log-probs under the frozen reference policy (needed when use_kl).
      entropy: [B, T] f32, policy entropy per token (needed when entropy_coef > 0; else metrics).

    Returns:
      loss: scalar, sum(weights * per-token loss).
      sums: masked token sums of statistics (tokens, clipped, dual_clipped, approx_kl, ratio,
        entropy, kl); divide by `tokens` for means.
    """
    log_ratio = jnp.clip(logp - old_logp, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = jnp.maximum(pg1, pg2)
    dual = jnp.zeros_like(mask)
    if cfg.dual_clip > 0:
        pg3 = -advantages * cfg.dual_clip
        dual = (advantages < 0) & (pg > pg3)
        pg = jnp.where(advantages < 0, jnp.minimum(pg, pg3), pg)
    per_token = pg
    m = mask.astype(jnp.float32)
    sums = {
        "tokens": m.sum(),
        "clipped": (m * (pg2 > pg1)).sum(),
        "dual_clipped": (m * dual).sum(),
        # k3 estimate of KL(old || new): non-negative, low variance.
        "approx_kl": (m * (ratio - 1.0 - log_ratio)).sum(),
        "ratio": (m * ratio).sum(),
    }
    if cfg.use_kl:
        if ref_logp is None:
            raise ValueError("policy_loss: cfg.use_kl needs ref_logp")
        kl = k3_kl(logp, ref_logp, cfg.kl_clamp)
        per_token = per_token + cfg.kl_coef * kl
        sums["kl"] = (m * kl).sum()
    if entropy is not None:
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy
        sums["entropy"] = (m * jax.lax.stop_gradient(entropy)).sum()
    elif cfg.entropy_coef > 0:
        raise ValueError("policy_loss: cfg.entropy_coef > 0 needs entropy")
    loss = jnp.sum(jnp.where(mask, weights * per_token, 0.0))
    return loss, sums


def sft_loss(
    logp: jax.Array, weights: jax.Array, mask: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy sum(weights * -logp) over trained tokens; sums hold tokens and total nll."""
    m = mask.astype(jnp.float32)
    loss = jnp.sum(jnp.where(mask, -weights * logp, 0.0))
    return loss, {"tokens": m.sum(), "nll": -(m * logp).sum()}
