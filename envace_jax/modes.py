"""The training modes, declared once: one row per (mode, rehearsal view).

Every mode runs through the same train job (warm start -> RL steps -> held-out evaluation) with
the same budget; the modes differ only in where an RL step's batch comes from, who writes the
tool responses in it, which roles' tokens train, and how many parameter sets there are.

==================  ========  ===========  ============================  ==============  ====
mode                view      RL batch     tool responses written by     trained roles   sets
==================  ========  ===========  ============================  ==============  ====
envace              shared    rehearsal    the policy, in its sequence   ACT + REHEARSE  1
envace              grounded  rehearsal    the policy, from a simulator  ACT + REHEARSE  1
                                           prompt with logged responses
envace_noshare      shared    rehearsal    a second trained set          each its role   2
external_simulator  shared    rehearsal    a frozen warm-start copy      ACT             2
grpo_real_env       any       environment  the real environment          ACT             1
corrupted_world     any       corrupted    a corrupted copy of the world ACT             1
sft_only            any       none         -                             -               1
==================  ========  ===========  ============================  ==============  ====

A row names the class that carries the mode out inside the train job (`strategy`, imported
only when a job runs, so that a config is checked without loading JAX). A new mode is one row
here and one class (`train.strategies` holds the project's); `added` registers a row for the
duration of a block, for tests and experiments. The configuration's `mode` and
`rollout.rehearsal_view` must name a row (`lookup`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator

VIEWS = ("shared", "grounded")  # rollout.rehearsal_view: how world rehearsal writes responses
BATCHES = ("rehearsal", "environment", "corrupted", "none")  # where an RL batch comes from
ROLES = ("act", "rehearse")


@dataclasses.dataclass(frozen=True)
class Mode:
    """One row of the mode table.

    view: the `rollout.rehearsal_view` the row serves; None: any (no world rehearsal in RL).
    batch: where the RL batch comes from: world 'rehearsal' (no environment), host turns in the
      'environment', host turns in a 'corrupted' copy of the world, or 'none' (no RL phase).
    responses: who writes the tool responses of that batch (for people; the table above).
    trains: the roles whose tokens the RL step trains.
    role_params: ACT and REHEARSE sample with parameter sets of their own.
    strategy: 'package.module:Class' that carries the mode out in the train job.
    """

    name: str
    view: str | None
    batch: str
    responses: str
    trains: tuple[str, ...]
    role_params: bool
    strategy: str

    def __post_init__(self):
        if self.view is not None and self.view not in VIEWS:
            raise ValueError(f"mode {self.name!r}: view {self.view!r} is not one of {VIEWS}")
        if self.batch not in BATCHES:
            raise ValueError(f"mode {self.name!r}: batch {self.batch!r} is not one of {BATCHES}")
        if not set(self.trains) <= set(ROLES):
            raise ValueError(f"mode {self.name!r}: trains {self.trains} outside {ROLES}")

    @property
    def has_rl(self) -> bool:
        return self.batch != "none"

    def strategy_class(self) -> type:
        module, _, name = self.strategy.partition(":")
        return getattr(importlib.import_module(module), name)


def _row(name, view, batch, responses, trains, role_params, strategy) -> Mode:
    module = "envace_jax.train.strategies"
    return Mode(name, view, batch, responses, trains, role_params, f"{module}:{strategy}")


_ACT = ("act",)
_TABLE: list[Mode] = [
    _row("envace", "shared", "rehearsal", "the policy", ROLES, False, "SharedPolicy"),
    _row("envace", "grounded", "rehearsal", "the policy", ROLES, False, "GroundedPolicy"),
    _row("envace_noshare", "shared", "rehearsal", "a second set", ROLES, True, "RolePolicies"),
    _row("external_simulator", "shared", "rehearsal", "a frozen copy", _ACT, True, "RolePolicies"),
    _row("grpo_real_env", None, "environment", "the environment", _ACT, False, "RealEnvPolicy"),
    _row(
        "corrupted_world", None, "corrupted", "a wrong world", _ACT, False, "CorruptedWorldPolicy"
    ),
    _row("sft_only", None, "none", "-", (), False, "WarmStartOnly"),
]


def names() -> tuple[str, ...]:
    """Every mode name, in table order."""
    return tuple(dict.fromkeys(m.name for m in _TABLE))


def lookup(name: str, view: str | None = None) -> Mode:
    """The row of mode `name` in rehearsal view `view` (None: the mode's first row); raises
    ValueError naming the config key that is wrong."""
    rows = [m for m in _TABLE if m.name == name]
    if not rows:
        raise ValueError(f"config.mode = {name!r}: expected one of {names()}")
    for m in rows:
        if view is None or m.view in (None, view):
            return m
    views = tuple(m.view for m in rows)
    raise ValueError(f"rollout.rehearsal_view = {view!r}: mode {name!r} runs in the views {views}")


@contextlib.contextmanager
def added(*rows: Mode) -> Iterator[None]:
    """The table with `rows` added, inside the block."""
    _TABLE.extend(rows)
    try:
        yield
    finally:
        for m in rows:
            _TABLE.remove(m)


class _ModeNames(str):
    """The config rule's description: the names at the time of the error, not at import."""

    def __str__(self) -> str:
        return f"one of {names()}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


RULE = ((lambda v: v in names()), _ModeNames())  # the `mode` knob's rule
