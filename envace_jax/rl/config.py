"""Configuration of the RL and SFT steps: frozen dataclasses whose defaults follow the reference.

Each dataclass maps one ml_collections section (`rl`, `sft`, `optim`). `from_config` takes a
`ConfigDict` or a plain mapping, rejects unknown keys by name, and checks every value, so a typo
fails before anything is compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ROLE_IDS = {"act": 1, "rehearse": 2}  # Matches batch.ROLE_ACT / batch.ROLE_REHEARSE.

ADVANTAGE_BASELINES = ("role", "group")
SINGLETON_BASELINES = ("zero", "self")
LOSS_AGGREGATIONS = ("message-mean", "token-mean", "seq-mean-token-mean")
OLD_LOGPROB_SOURCES = ("recompute", "sampler")


def _as_mapping(cfg: Any, section: str) -> dict[str, Any]:
    if cfg is None:
        return {}
    if hasattr(cfg, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        cfg = cfg.to_dict()
    if not isinstance(cfg, Mapping):
        raise ValueError(f"config.{section}: expected a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def build(cls, cfg: Any, section: str):
    """Makes `cls` from mapping `cfg`; unknown keys and bad values raise naming `section.key`."""
    values = _as_mapping(cfg, section)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        names = ", ".join(f"config.{section}.{k}" for k in unknown)
        raise ValueError(f"unknown key(s) {names}; known keys: {', '.join(sorted(known))}")
    for key, value in values.items():
        if isinstance(value, list):  # ConfigDict stores tuples as given; JSON/CLI gives lists.
            values[key] = tuple(value)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:  # __post_init__ messages start with the key name.
        raise ValueError(f"config.{section}.{e}") from None


def _num(lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    def ok(v: Any) -> bool:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return hi is None or v < hi

    return ok


def _one_of(choices: tuple[str, ...]):
    return lambda v: v in choices, f"one of {choices}"


_BOOL = (lambda v: isinstance(v, bool), "a bool")
_COUNT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1")
_ROLES = (
    lambda v: (
        isinstance(v, tuple)
        and len(v) > 0
        and len(set(v)) == len(v)
        and all(r in ROLE_IDS for r in v)
    ),
    f"a non-empty tuple of distinct role names from {sorted(ROLE_IDS)}",
)


def _validate(cfg: Any, rules: dict[str, tuple[Any, str]]) -> None:
    for key, (ok, allowed) in rules.items():
        value = getattr(cfg, key)
        if not ok(value):
            raise ValueError(f"{key} = {value!r}: expected {allowed}")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Role-wise GRPO. Defaults reproduce the reference run (EnvACE `run_checklist_share.sh`)."""

    # --- advantages ---
    baseline: str = "role"  # 'role': mean over (group, role) outputs; 'group': pooled (ablation).
    norm_adv_by_std: bool = False  # Divide by the (group, role) std; off in the reference.
    std_eps: float = 1e-6  # Added to the std before dividing.
    singleton_baseline: str = "zero"  # One output in its (group, role): 'zero' (A = R, reference)
    # or 'self' (A = 0).
    empty_penalty: float = 0.1  # Subtracted from the score of an empty output (reference: 0.1).
    empty_max_tokens: int = 1  # An output of at most this many tokens (the stop token) is empty.
    train_roles: tuple[str, ...] = ("act", "rehearse")  # Roles whose tokens are trained.
    # --- policy loss ---
    clip_low: float = 0.2  # PPO ratio lower clip: ratio >= 1 - clip_low.
    clip_high: float = 0.2  # PPO ratio upper clip: ratio <= 1 + clip_high.
    dual_clip: float = 3.0  # Dual-clip bound c for negative advantages; 0 disables.
    log_ratio_clamp: float = 20.0  # |logp - logp_old| is clamped to this before exp.
    use_kl: bool = False  # KL to a frozen reference policy (off in the reference run).
    kl_coef: float = 1e-4  # Weight of the k3 KL term when use_kl.
    kl_clamp: float = 10.0  # The k3 estimate is clamped to [-kl_clamp, kl_clamp].
    entropy_coef: float = 0.0  # Weight of the entropy bonus (subtracted from the loss).
    loss_agg: str = "message-mean"  # 'message-mean', 'token-mean' or 'seq-mean-token-mean'.
    temperature: float = 1.0  # Logits are divided by the sampling temperature before log-softmax.
    # --- update schedule ---
    old_logprobs: str = "recompute"  # 'recompute' with the step's starting params (reference) or
    # 'sampler' (the logprobs stored in the batch).
    epochs: int = 1  # Passes over the rollout batch (PPO epochs).
    mini_batches: int = 1  # Optimizer updates per pass; the rows are split evenly.
    micro_batches: int = 1  # Gradient-accumulation chunks per update.

    def __post_init__(self):
        _validate(self, _GRPO_RULES)

    @classmethod
    def from_config(cls, cfg: Any, section: str = "rl") -> GRPOConfig:
        return build(cls, cfg, section)

    @property
    def train_role_ids(self) -> tuple[int, ...]:
        return tuple(ROLE_IDS[r] for r in self.train_roles)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start: cross-entropy on the generated tokens of the chosen roles."""

    train_roles: tuple[str, ...] = ("act", "rehearse")  # Roles whose tokens carry the loss.
    loss_agg: str = "token-mean"  # 'token-mean', 'message-mean' or 'seq-mean-token-mean'.
    # Weight of a language-model loss on the context tokens (system and user turns, chat glue)
    # next to the trained roles' loss (weight 1). 0 = plain SFT. A policy trained from scratch
    # (the demo) learns to read the prompt's records and copy from them sooner with it.
    context_weight: float = 0.0
    mini_batches: int = 1  # Optimizer updates per batch; the rows are split evenly.
    micro_batches: int = 1  # Gradient-accumulation chunks per update.

    def __post_init__(self):
        _validate(self, _SFT_RULES)

    @classmethod
    def from_config(cls, cfg: Any, section: str = "sft") -> SFTConfig:
        return build(cls, cfg, section)

    @property
    def train_role_ids(self) -> tuple[int, ...]:
        return tuple(ROLE_IDS[r] for r in self.train_roles)


_GRPO_RULES = {
    "baseline": _one_of(ADVANTAGE_BASELINES),
    "norm_adv_by_std": _BOOL,
    "std_eps": (_num(0, lo_open=True), "a number > 0"),
    "singleton_baseline": _one_of(SINGLETON_BASELINES),
    "empty_penalty": (_num(), "a number"),
    "empty_max_tokens": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "train_roles": _ROLES,
    "clip_low": (_num(0, 1), "a number in [0, 1)"),
    "clip_high": (_num(0), "a number >= 0"),
    "dual_clip": (lambda v: _num(1, lo_open=True)(v) or v == 0, "0 (off) or a number > 1"),
    "log_ratio_clamp": (_num(0, lo_open=True), "a number > 0"),
    "use_kl": _BOOL,
    "kl_coef": (_num(0), "a number >= 0"),
    "kl_clamp": (_num(0, lo_open=True), "a number > 0"),
    "entropy_coef": (_num(0), "a number >= 0"),
    "loss_agg": _one_of(LOSS_AGGREGATIONS),
    "temperature": (_num(0, lo_open=True), "a number > 0"),
    "old_logprobs": _one_of(OLD_LOGPROB_SOURCES),
    "epochs": _COUNT,
    "mini_batches": _COUNT,
    "micro_batches": _COUNT,
}

_SFT_RULES = {
    "train_roles": _ROLES,
    "loss_agg": _one_of(LOSS_AGGREGATIONS),
    "context_weight": (_num(0), "a number >= 0"),
    "mini_batches": _COUNT,
    "micro_batches": _COUNT,
}
