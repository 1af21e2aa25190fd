"""Corrupted copies of the demo world: the sensitivity control of the rehearsal comparison.

RL against a corrupted copy (mode 'corrupted_world', `rollout.corruption`) is real-environment
GRPO whose tool responses come from a wrong world, and the same judge scores the trajectories
against the task's true checklist, as it scores rehearsed ones. How far such an arm falls
below GRPO in the real world measures how well the comparison can tell a right world from a
wrong one; without it, "world rehearsal learns as much as the real environment" says nothing.

* ``redrawn``: in a task of the hidden stratum, every status (orders and accounts) is redrawn
  from the distribution the task generator draws a task's branch from, so a lookup shows a
  plausible state that is not the task's; the world then answers by its rules from that state.
  A visible task's statuses are in its context, not hidden, and stay. This is the best a
  rehearser can do that reads everything the context shows and guesses the rest.
* ``optimist``: the world is the task's, but it never refuses a change it has the entities for
  (`tools.execute(strict=False)`): a wrong branch's change answers like a success.
* ``guesser``: both, as a simulator that guesses the state it cannot read and agrees to every
  change. A `redrawn` world stays consistent: it refuses the changes its own lookups rule out,
  so the reward, which wants the task's true change, still pays for following the lookup
  whenever the guess is right. A guesser's lookups predict nothing the reward pays for.
* ``blind``: ``redrawn`` in every task, the visible stratum's included: a simulator that reads
  nothing of the context, whose lookups and refusals contradict the statuses the prompt shows.
* ``liar``: in every task, every status is replaced by a fixed other one (open -> shipped ->
  cancelled -> open, refunded -> open, active <-> frozen), and the world answers by its rules
  from there: a simulator that learnt the dynamics wrong. Unlike a redraw it never lands on the
  task's state by chance, so the reward never pays for following a lookup; it pays only for
  telling the user, when the lookup shows a state that calls for a change.

Each episode is corrupted with probability `rate` (0 gives the real world, call for call).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from envace_jax.envs.base import CORRUPTIONS
from envace_jax.envs.demo.env import DemoEnv
from envace_jax.envs.demo.families import CLOSE_BRANCHES, SWEEP_BRANCHES
from envace_jax.envs.demo.world import (
    ACTIVE,
    CANCELLED,
    FROZEN,
    OPEN,
    REFUNDED,
    SHIPPED,
    World,
    copy_world,
)


def _order_status(rng: random.Random) -> str:
    """An order status as close tasks draw their branch: open, shipped or closed (cancelled
    or refunded) equally often."""
    branch = rng.choice(CLOSE_BRANCHES)
    return {"open": "open", "shipped": "shipped"}.get(branch) or rng.choice((CANCELLED, REFUNDED))


def redraw(world: World, rng: random.Random) -> World:
    """A copy of `world` with every order and account status redrawn from the branch
    distribution of the tasks (independently of the task's own)."""
    out = copy_world(world)
    for order in out["orders"]:
        order["status"] = _order_status(rng)
    for account in out["accounts"]:
        account["status"] = rng.choice(SWEEP_BRANCHES)
    return out


# The liar's fixed map: every status to one whose branch differs.
_LIES = {
    OPEN: SHIPPED,
    SHIPPED: CANCELLED,
    CANCELLED: OPEN,
    REFUNDED: OPEN,
    ACTIVE: FROZEN,
    FROZEN: ACTIVE,
}


def lie(world: World, rng: random.Random | None = None) -> World:
    """A copy of `world` with every order and account status replaced by `_LIES`'s (`rng`
    unused: every rewrite of `_KINDS` takes one)."""
    out = copy_world(world)
    for record in (*out["orders"], *out["accounts"]):
        record["status"] = _LIES[record["status"]]
    return out


# Each corruption: the stratum whose statuses it rewrites ('all', or None for none), how, and
# whether it refuses the changes its own state rules out.
_KINDS = {
    "redrawn": ("hidden", redraw, True),
    "optimist": (None, None, False),
    "guesser": ("hidden", redraw, False),
    "blind": ("all", redraw, True),
    "liar": ("all", lie, True),
}


class CorruptedEnv(DemoEnv):
    """The demo environment on a corrupted copy of each task's world (`kind`), or on the real
    one when `corrupt` is False."""

    def __init__(self, kind: str, corrupt: bool, rng: random.Random) -> None:
        if kind not in CORRUPTIONS:
            raise ValueError(f"corruption {kind!r}: expected one of {CORRUPTIONS}")
        super().__init__()
        self.kind, self.corrupt, self._rng = kind, corrupt, rng
        self.rewrites, self._rewrite, refuses = _KINDS[kind]
        self.strict = refuses or not corrupt

    def reset(self, task: Any) -> None:
        super().reset(task)
        metadata = task.get("metadata", {}) if isinstance(task, dict) else task.metadata
        if self.corrupt and self.rewrites in ("all", metadata.get("stratum")):
            self._world = self._rewrite(self._world, self._rng)


def corrupted_envs(kind: str, rate: float, seed: int) -> Callable[[], CorruptedEnv]:
    """An environment factory whose n-th environment is corrupted with probability `rate`,
    drawn with its own generator from (`seed`, n): deterministic in the order of the calls."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"corruption rate {rate}: expected a number in [0, 1]")
    count = 0

    def make() -> CorruptedEnv:
        nonlocal count
        rng = random.Random(f"{seed}-{count}-corrupt")
        count += 1
        return CorruptedEnv(kind, rng.random() < rate, rng)

    return make
