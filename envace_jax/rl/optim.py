"""The Optax optimizer from config: global-norm clipping, then AdamW on a warmup schedule.

Defaults follow the reference (torch AdamW, lr 1e-6 constant, betas 0.9/0.999, eps 1e-8,
weight decay 0.01 on every parameter, grad clip 1.0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from envace_jax.rl import config as _config

SCHEDULES = ("constant", "cosine", "linear")
DECAY_MASKS = ("all", "matrices")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping; the `optim` config section."""

    learning_rate: float = 1e-6  # Peak learning rate.
    schedule: str = "constant"  # 'constant', 'cosine' or 'linear' decay after warmup.
    warmup_steps: int = 0  # Linear warmup from 0 over this many optimizer updates.
    decay_steps: int = 0  # Updates from the end of warmup to the end of decay (cosine/linear).
    end_lr_ratio: float = 0.0  # Final lr as a fraction of the peak (cosine/linear).
    b1: float = 0.9  # Adam beta1.
    b2: float = 0.999  # Adam beta2.
    eps: float = 1e-8  # Adam epsilon (torch default).
    weight_decay: float = 0.01  # Decoupled weight decay.
    weight_decay_mask: str = "all"  # 'all' params (reference) or 'matrices' (ndim >= 2 only).
    grad_clip: float = 1.0  # Clip the global gradient norm to this; 0 disables.

    def __post_init__(self):
        _config._validate(self, _RULES)
        if self.schedule != "constant" and self.decay_steps < 1:
            raise ValueError(
                f"decay_steps = {self.decay_steps}: schedule {self.schedule!r} needs decay_steps"
                " >= 1"
            )

    @classmethod
    def from_config(cls, cfg: Any, section: str = "optim") -> OptimConfig:
        return _config.build(cls, cfg, section)


_NONNEG = (_config._num(0), "a number >= 0")
_STEPS = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0")
_RULES = {
    "learning_rate": _NONNEG,
    "schedule": _config._one_of(SCHEDULES),
    "warmup_steps": _STEPS,
    "decay_steps": _STEPS,
    "end_lr_ratio": _NONNEG,
    "b1": (_config._num(0, 1), "a number in [0, 1)"),
    "b2": (_config._num(0, 1), "a number in [0, 1)"),
    "eps": _NONNEG,
    "weight_decay": _NONNEG,
    "weight_decay_mask": _config._one_of(DECAY_MASKS),
    "grad_clip": _NONNEG,
}


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Learning rate as a function of the optimizer update count."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.end_lr_ratio
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, cfg.decay_steps, alpha=cfg.end_lr_ratio)
    else:
        after = optax.linear_schedule(peak, end, cfg.decay_steps)
    if cfg.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


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
