"""The Optax optimizer from config: global-norm clipping, then AdamW on a warmup schedule.

The config section and its defaults (the reference's) are `envace_jax.rl.config.OptimConfig`.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from envace_jax.rl.config import OptimConfig


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Learning rate as a function of the optimizer update count."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.end_lr_ratio
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "step":
        after = optax.constant_schedule(end)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, cfg.decay_steps, alpha=cfg.end_lr_ratio)
    else:
        after = optax.linear_schedule(peak, end, cfg.decay_steps)
    if cfg.warmup_steps == 0:
        return after
    # Update k of the warmup (k = 0, 1, ...) runs at peak * (k + 1) / warmup_steps: a warmup
    # from 0 would spend its first update at lr 0, and a short RL phase half its budget there.
    w = cfg.warmup_steps
    warmup = optax.linear_schedule(peak / w, peak, w - 1)
    return optax.join_schedules([warmup, after], [w])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) -> AdamW(schedule); the update count lives in the state."""
    mask = None
    if cfg.weight_decay_mask == "matrices":
        mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(
        make_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=mask,
    )
    if cfg.grad_clip == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)


def opt_state_shardings(
    tx: optax.GradientTransformation, params: Any, param_shardings: Any, mesh: jax.sharding.Mesh
) -> Any:
    """Shardings for `tx.init(params)`: moment trees follow their parameters, scalars replicate.

    Args:
      params: the parameter pytree (arrays or ShapeDtypeStructs).
      param_shardings: the same pytree of NamedShardings.
    """
    state_shape = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        state_shape,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )
