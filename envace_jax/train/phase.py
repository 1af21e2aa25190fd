"""The loop frame's parts that are not the Trainer: a phase's plug-ins (`Phase`), the finite
check that stops a diverged run, and the hooks a caller observes a run with."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax


class TrainingDiverged(RuntimeError):
    """A loss or gradient norm was NaN or inf."""


def check_finite(metrics: dict[str, float], phase: str, step: int, last_good) -> None:
    """Stops the run, without saving, at a non-finite loss or gradient norm."""
    bad = [k for k in ("loss", "grad_norm") if k in metrics and not math.isfinite(metrics[k])]
    if bad:
        raise TrainingDiverged(
            f"{phase} step {step}: {', '.join(f'{k}={metrics[k]}' for k in bad)}; stopping "
            f"without saving. The last good checkpoint is step {last_good}."
        )


def ignore(*args) -> None:
    pass


@dataclasses.dataclass
class Hooks:
    """Callbacks with which a caller (a test, a tool) observes a run without patching it."""

    on_checkpoint: Callable[[int, Any, dict], None] = ignore  # (step, state, meta), after a save
    on_finish: Callable[[Any], None] = ignore  # (final state), before the outputs are written


@dataclasses.dataclass(frozen=True)
class Phase:
    """What one phase plugs into the loop frame (`trainer.Trainer._loop`). Steps are numbered
    1..steps inside the phase and `offset` + that globally.

    step(state, i) -> (state, metrics): one update (metrics: arrays or floats).
    logs(i): whether step i writes a metrics row (and checks that the update is finite).
    shown(state, i, m) -> dict: adds what the row also holds to `m`, returns what the
      progress line shows.
    after(state, i): runs after the row is written (e.g. an evaluation).
    meta(i): the checkpoint's meta after step i.
    """

    name: str  # metrics phase: 'sft' or 'rl'
    what: str  # how errors name a step of it
    title: str  # its progress line
    offset: int
    steps: int
    step: Callable[[Any, int], tuple[Any, dict]]
    logs: Callable[[int], bool]
    shown: Callable[[Any, int, dict], dict]
    after: Callable[[Any, int], None]
    meta: Callable[[int], dict]


def float_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics with device values read to floats (host values are kept as they are)."""
    return {k: float(v) if isinstance(v, jax.Array) else v for k, v in metrics.items()}
