"""Role-wise GRPO advantages from segment masks, computed inside the jitted step.

The reference trains one row per generated message; every row carries its trajectory's score,
and the baseline of a row is the mean score over all rows with the same (instruction, role) key.
Here a message is a segment of a packed trajectory row. Per-segment sums over a flat
(row, segment) index give each message's token count and role, and per-key sums over
(group, role) give the baselines, so the result equals the reference's row-wise computation
without materialising rows.

For a message m of role r in row i (group g): score_m = R_i - empty_penalty * [m is empty],
baseline[g, r] = mean of score over the messages of role r in group g (a trajectory with more
messages weighs more), and A_m = score_m - baseline[g, r] (divided by the (g, r) std plus eps
when norm_adv_by_std). Every token of m gets A_m; context tokens get 0.

Departures from the reference, on purpose:
- "Empty" output: the reference penalises a row whose decoded text is empty (only special
  tokens). Here a message is empty when it has at most `empty_max_tokens` tokens (default 1:
  the stop token alone), which needs no detokenisation inside the step.
- Padding: the reference pads its row count to a device multiple by duplicating random rows
  before computing baselines, so duplicates shift the means. Padding rows here carry no
  messages and change nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from envace_jax.rl.config import GRPOConfig
from envace_jax.text.codes import Role


def segment_table(roles: jax.Array, segments: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token count and role of every (row, segment) slot.

    Args:
      roles: [B, T] role per token.
      segments: [B, T] segment id per token (0 = context, 1..S messages; S <= T).

    Returns:
      ntok: [B, T + 1] int32 tokens in segment s of row b (slot 0 counts context tokens).
      role: [B, T + 1] int32 role of segment s of row b (meaningless where ntok == 0 or s == 0).
    """
    b, t = segments.shape
    slots = t + 1
    flat = (jnp.arange(b, dtype=jnp.int32)[:, None] * slots + segments.astype(jnp.int32)).ravel()
    ntok = jax.ops.segment_sum(jnp.ones_like(flat), flat, b * slots)
    # Roles are constant within a segment, so any reduction picks that role.
    role = jax.ops.segment_max(roles.astype(jnp.int32).ravel(), flat, b * slots)
    return ntok.reshape(b, slots), role.reshape(b, slots)


def message_mask(ntok: jax.Array) -> jax.Array:
    """[B, S+1] bool: slot holds a generated message (non-empty, not the context slot)."""
    return (ntok > 0) & (jnp.arange(ntok.shape[1]) > 0)[None, :]


def compute_advantages(
    roles: jax.Array,
    segments: jax.Array,
    group: jax.Array,
    reward: jax.Array,
    cfg: GRPOConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token advantages [B, T] f32 and per-role statistics.

    Args:
      roles: [B, T] int, segments: [B, T] int, group: [B] int in [0, B), reward: [B] float.
      cfg: uses baseline, norm_adv_by_std, std_eps, singleton_baseline, empty_penalty,
        empty_max_tokens.

    Returns:
      advantages: [B, T] f32, A of the token's message; 0 on context and padding.
      metrics: scalars per role name (act, rehearse): outputs, tokens, empty outputs, advantage
        mean and std over outputs.
    """
    b, t = segments.shape
    ntok, seg_role = segment_table(roles, segments)
    is_msg = message_mask(ntok)
    empty = is_msg & (ntok <= cfg.empty_max_tokens)
    score = reward.astype(jnp.float32)[:, None] - cfg.empty_penalty * empty.astype(jnp.float32)

    if cfg.baseline == "role":
        key = group.astype(jnp.int32)[:, None] * len(Role) + jnp.clip(seg_role, 0, len(Role) - 1)
    else:  # "group": one pooled baseline per instruction (ablation).
        key = jnp.broadcast_to(group.astype(jnp.int32)[:, None] * len(Role), ntok.shape)
    key = jnp.where(is_msg, key, 0).ravel()
    n_keys = b * len(Role)
    w = is_msg.astype(jnp.float32).ravel()
    count = jax.ops.segment_sum(w, key, n_keys)
    mean = jax.ops.segment_sum(w * score.ravel(), key, n_keys) / jnp.maximum(count, 1.0)
    # Two-pass unbiased variance (torch.std's default, as in the reference).
    dev = score.ravel() - mean[key]
    var = jax.ops.segment_sum(w * dev * dev, key, n_keys) / jnp.maximum(count - 1.0, 1.0)
    std = jnp.sqrt(var)
    single = count == 1.0
    if cfg.singleton_baseline == "zero":  # Reference: mean 0, std 1, so A = score.
        mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)

    adv_seg = score.ravel() - mean[key]
    if cfg.norm_adv_by_std:
        adv_seg = adv_seg / (std[key] + cfg.std_eps)
    adv_seg = jnp.where(is_msg.ravel(), adv_seg, 0.0).reshape(b, t + 1)
    token_adv = jnp.take_along_axis(adv_seg, segments.astype(jnp.int32), axis=1)
    token_adv = jnp.where(segments > 0, token_adv, 0.0)

    metrics = {}
    for r in Role.generated():
        sel = is_msg & (seg_role == r)
        n = sel.sum()
        a_mean = jnp.where(sel, adv_seg, 0.0).sum() / jnp.maximum(n, 1)
        a_var = jnp.where(sel, (adv_seg - a_mean) ** 2, 0.0).sum() / jnp.maximum(n, 1)
        name = r.label
        metrics[f"{name}/outputs"] = n.astype(jnp.float32)
        metrics[f"{name}/tokens"] = jnp.where(sel, ntok, 0).sum().astype(jnp.float32)
        metrics[f"{name}/empty_outputs"] = (sel & empty).sum().astype(jnp.float32)
        metrics[f"{name}/adv_mean"] = a_mean
        metrics[f"{name}/adv_std"] = jnp.sqrt(a_var)
    return token_adv, metrics


def role_mask(roles: jax.Array, segments: jax.Array, role_ids: tuple[int, ...]) -> jax.Array:
    """[B, T] bool: generated tokens whose role is in `role_ids` (the tokens that are trained)."""
    keep = jnp.zeros(roles.shape, bool)
    for r in role_ids:
        keep = keep | (roles == r)
    return keep & (segments > 0)
