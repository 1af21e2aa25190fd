"""Run metrics: JSON lines and TensorBoard event files in the workdir, progress lines with rate
and ETA, a PNG plot of the curves people look at, and a summary table."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _plain(value: Any) -> Any:
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value.tolist()


class MetricsWriter:
    """Appends `{"step", "phase", ...metrics}` lines to `workdir/metrics.jsonl` and writes the
    same scalars as TensorBoard events under `workdir/tensorboard` (tensorboardX, no TensorFlow).

    Only one process of a multi-host run should write (pass `enabled=False` elsewhere)."""

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(
        self, step: int, phase: str, metrics: Mapping[str, Any], global_step: int | None = None
    ) -> dict[str, Any]:
        row = {"step": int(step), "phase": phase, "time": time.time()}
        row["global_step"] = int(step if global_step is None else global_step)
        row.update({k: _plain(v) for k, v in metrics.items()})
        if not self.enabled:
            return row
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key not in ("step", "global_step", "time") and isinstance(value, (int, float)):
                self._tb.add_scalar(f"{phase}/{key}", value, int(step))
        self._tb.flush()
        return row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def truncate_metrics(path: str, last_global_step: int) -> None:
    """Drops rows written after `last_global_step` (a resumed run writes them again)."""
    rows = [r for r in read_metrics(path) if r.get("global_step", 0) <= last_global_step]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def read_metrics(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """Periodic one-line progress: done/total, rate, ETA and chosen metrics."""

    def __init__(self, name: str, total: int, start: int = 0, stream=None):
        self.name, self.total, self.start = name, total, start
        self.t0 = time.time()
        self.stream = stream or sys.stdout

    def update(self, done: int, **metrics: float) -> None:
        elapsed = time.time() - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else math.inf
        shown = " ".join(f"{k}={v:.3g}" for k, v in metrics.items())
        eta_s = f"{eta:.0f}s" if math.isfinite(eta) else "?"
        print(
            f"[{self.name}] {done}/{self.total} {rate:.2f} steps/s eta {eta_s} {shown}",
            file=self.stream,
            flush=True,
        )


def plot_curves(
    rows: Sequence[Mapping[str, Any]], png_path: str, panels: Sequence[tuple[str, str, str]]
) -> None:
    """One panel per (phase, key, title): the key's value over steps, from metric rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (phase, key, title) in zip(axes[0], panels, strict=True):
        pts = [(r["step"], r[key]) for r in rows if r.get("phase") == phase and key in r]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def verdict(difference: float, se: float) -> str:
    """A claim's verdict from a difference and its standard error over seeds: 'supported'
    beyond twice the standard error, 'contradicted' below minus twice it, else 'not resolved'
    (seed noise can explain it)."""
    if difference > 2 * se and difference > 0:
        return "supported"
    if difference < -2 * se and difference < 0:
        return "contradicted"
    return "not resolved"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A Markdown table (numbers to 3 decimals)."""
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
