"""Configuration of the RL and SFT steps and their optimizer: frozen dataclasses whose defaults
follow the reference.

Each dataclass is a config section (`envace_jax.knobs`): `grpo`, `sft`, and `optim` /
`sft_optim` of the job config (`envace_jax.configuration`). Each field carries its rule, so a
value is checked whether the section comes from a config file, a checkpoint's config.json or
code. `from_config` takes a `ConfigDict` or a plain mapping and names an unknown key or a bad
value as `config.<section>.<key>`. Imports nothing heavy (the job config is checked before JAX).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from envace_jax.knobs import BOOL, Rule, Section, integer, knob, number, one_of
from envace_jax.text.codes import Role

ROLE_IDS = {r.label: int(r) for r in Role.generated()}  # Config role name -> role id.

ADVANTAGE_BASELINES = ("role", "group")
SINGLETON_BASELINES = ("zero", "self")
LOSS_AGGREGATIONS = ("message-mean", "token-mean", "seq-mean-token-mean")
OLD_LOGPROB_SOURCES = ("recompute", "sampler")
SCHEDULES = ("constant", "cosine", "linear", "step")
DECAY_SCHEDULES = ("cosine", "linear")  # the schedules that need decay_steps
DECAY_MASKS = ("all", "matrices")


def _roles_ok(v: Any) -> bool:
    return isinstance(v, tuple) and 0 < len(v) == len(set(v)) and all(r in ROLE_IDS for r in v)


_ROLES: Rule = (_roles_ok, f"a non-empty tuple of distinct role names from {sorted(ROLE_IDS)}")
_DUAL_CLIP: Rule = (
    lambda v: number(1, lo_open=True)[0](v) or v == 0,
    "0 (off) or a finite number > 1",
)
_ROLE_NAMES = tuple(ROLE_IDS)  # every generated role


class _TrainedRoles(Section):
    """A step's section whose loss covers the tokens of its `train_roles`."""

    @property
    def train_role_ids(self) -> tuple[int, ...]:
        return tuple(ROLE_IDS[r] for r in self.train_roles)


@dataclasses.dataclass(frozen=True)
class GRPOConfig(_TrainedRoles):
    """Role-wise GRPO. Defaults reproduce the reference run (EnvACE `run_checklist_share.sh`)."""

    config_key: ClassVar[str] = "grpo"
    # --- advantages ---
    # 'role': mean over (group, role) outputs; 'group': pooled (ablation).
    baseline: str = knob("role", one_of(*ADVANTAGE_BASELINES))
    norm_adv_by_std: bool = knob(False, BOOL)  # Divide by the (group, role) std (reference: off).
    std_eps: float = knob(1e-6, number(0, lo_open=True))  # Added to the std before dividing.
    # One output in its (group, role): 'zero' (A = R, reference) or 'self' (A = 0).
    singleton_baseline: str = knob("zero", one_of(*SINGLETON_BASELINES))
    # Subtracted from the score of an empty output (reference: 0.1).
    empty_penalty: float = knob(0.1, number())
    # An output of at most this many tokens (the stop token) is empty.
    empty_max_tokens: int = knob(1, integer(0))
    train_roles: tuple[str, ...] = knob(_ROLE_NAMES, _ROLES)  # Roles whose tokens are trained.
    # --- policy loss ---
    clip_low: float = knob(0.2, number(0, 1, hi_open=True))  # Ratio >= 1 - clip_low.
    clip_high: float = knob(0.2, number(0))  # PPO ratio upper clip: ratio <= 1 + clip_high.
    dual_clip: float = knob(3.0, _DUAL_CLIP)  # Dual-clip bound c for negative advantages.
    # |logp - logp_old| is clamped to this before exp.
    log_ratio_clamp: float = knob(20.0, number(0, lo_open=True))
    use_kl: bool = knob(False, BOOL)  # KL to a frozen reference policy (off in the reference).
    kl_coef: float = knob(1e-4, number(0))  # Weight of the k3 KL term when use_kl.
    kl_clamp: float = knob(10.0, number(0, lo_open=True))  # k3 is clamped to [-this, this].
    # Weight of the entropy bonus (subtracted from the loss).
    entropy_coef: float = knob(0.0, number(0))
    # 'message-mean', 'token-mean' or 'seq-mean-token-mean'.
    loss_agg: str = knob("message-mean", one_of(*LOSS_AGGREGATIONS))
    # Logits are divided by the sampling temperature before log-softmax.
    temperature: float = knob(1.0, number(0, lo_open=True))
    # --- update schedule ---
    # 'recompute' with the step's starting params (reference) or 'sampler' (the logprobs stored
    # in the batch).
    old_logprobs: str = knob("recompute", one_of(*OLD_LOGPROB_SOURCES))
    epochs: int = knob(1, integer(1))  # Passes over the rollout batch (PPO epochs).
    mini_batches: int = knob(1, integer(1))  # Optimizer updates per pass; rows split evenly.
    micro_batches: int = knob(1, integer(1))  # Gradient-accumulation chunks per update.


@dataclasses.dataclass(frozen=True)
class SFTConfig(_TrainedRoles):
    """Supervised warm start: cross-entropy on the generated tokens of the chosen roles."""

    config_key: ClassVar[str] = "sft"
    train_roles: tuple[str, ...] = knob(_ROLE_NAMES, _ROLES)  # Roles whose tokens carry the loss.
    # 'token-mean', 'message-mean' or 'seq-mean-token-mean'.
    loss_agg: str = knob("token-mean", one_of(*LOSS_AGGREGATIONS))
    # Weight of a language-model loss on the context tokens (system and user turns, chat glue)
    # next to the trained roles' loss (weight 1). 0 = plain SFT. A policy trained from scratch
    # (the demo) learns to read the prompt's records and copy from them sooner with it.
    context_weight: float = knob(0.0, number(0))
    mini_batches: int = knob(1, integer(1))  # Optimizer updates per batch; rows split evenly.
    micro_batches: int = knob(1, integer(1))  # Gradient-accumulation chunks per update.


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW with global-norm clipping (`envace_jax.rl.optim`). Defaults follow the reference
    (torch AdamW, lr 1e-6 constant, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on every
    parameter, grad clip 1.0)."""

    config_key: ClassVar[str] = "optim"
    learning_rate: float = knob(1e-6, number(0))  # Peak learning rate.
    # After the warmup: 'constant' at the peak, 'cosine' or 'linear' decay to the end rate, or
    # 'step' to the end rate from the first update after the warmup on.
    schedule: str = knob("constant", one_of(*SCHEDULES))
    # Linear warmup over this many updates, from peak / warmup_steps up to the peak.
    warmup_steps: int = knob(0, integer(0))
    # Updates from the end of warmup to the end of decay (cosine/linear).
    decay_steps: int = knob(0, integer(0))
    end_lr_ratio: float = knob(0.0, number(0))  # Final lr / peak lr (cosine/linear/step).
    b1: float = knob(0.9, number(0, 1, hi_open=True))  # Adam beta1.
    b2: float = knob(0.999, number(0, 1, hi_open=True))  # Adam beta2.
    eps: float = knob(1e-8, number(0))  # Adam epsilon (torch default).
    weight_decay: float = knob(0.01, number(0))  # Decoupled weight decay.
    # 'all' params (reference) or 'matrices' (ndim >= 2 only).
    weight_decay_mask: str = knob("all", one_of(*DECAY_MASKS))
    grad_clip: float = knob(1.0, number(0))  # Clip the global gradient norm to this; 0 disables.

    def __post_init__(self):
        super().__post_init__()
        if self.schedule in DECAY_SCHEDULES and self.decay_steps < 1:
            raise ValueError(
                f"decay_steps = {self.decay_steps}: schedule {self.schedule!r} needs decay_steps"
                " >= 1"
            )


def chunking_problem(rows: int, mini: int, micro: int, section: str) -> str | None:
    """Why `rows` cannot be split into mini x micro equal chunks (None when they can); checked
    on the job config before anything is compiled, and on each batch by the train steps."""
    if rows % (mini * micro):
        return (
            f"cannot be split into config.{section}.mini_batches={mini} x "
            f"config.{section}.micro_batches={micro} equal chunks"
        )
    return None
