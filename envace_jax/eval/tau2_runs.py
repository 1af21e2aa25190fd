"""tau2-bench runs as the harness follows them: progress from tau2's results file and the
launcher's model-call counts, and the summary of tau2's own scores (`envace_jax.eval.tau2`)."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

# The launcher's model-call reports on tau2's output: `CALLS agent=N user=M`.
CALLS = "@@envace-tau2-calls"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Watches tau2's results file (it appends each finished simulation): prints tasks done /
    total as they finish and every `every` seconds, and keeps the last complete version of the
    file (a stop can cut tau2 in the middle of rewriting it)."""

    def __init__(self, path: Path, every: float, out=None):
        self.path, self.every, self.out = path, every, out or sys.stdout
        self.last_good: str | None = None
        self.stop_event = threading.Event()
        self.start = time.monotonic()
        self.done0: int | None = None
        self.calls: dict[str, int] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _read(self):
        try:
            text = self.path.read_text()
            data = json.loads(text)
        except (OSError, ValueError):
            return None
        self.last_good = text
        return data

    def line(self, data) -> str:
        sims = data["simulations"]
        total = len(data["tasks"]) * int(data["info"]["num_trials"])
        done, failed = len(sims), sum(1 for s in sims if s.get("skipped"))
        if self.done0 is None:
            self.done0 = done
        elapsed = time.monotonic() - self.start
        msg = f"[tau2] {done}/{total} tasks done"
        if failed:
            msg += f" ({failed} failed with an error)"
        if self.calls:
            agent, user, errors = (self.calls.get(k, 0) for k in ("agent", "user", "failed"))
            msg += f", {agent + user} model calls (agent {agent}, user {user}"
            msg += f", {errors} failed)" if errors else ")"
        msg += f", {_clock(elapsed)} elapsed"
        new = done - self.done0
        if new > 0:
            per = elapsed / new
            msg += f", {per:.1f} s/task, ~{_clock(per * (total - done))} left"
        return msg

    def _run(self):
        mtime, shown, last_print = None, None, time.monotonic()
        while not self.stop_event.wait(1.0):
            with contextlib.suppress(OSError):
                m = self.path.stat().st_mtime_ns
                if m != mtime:
                    data = self._read()
                    if data is not None:
                        mtime = m
                        if self.done0 is None:  # the count when this run began (resumed runs)
                            self.done0 = len(data["simulations"])
                        count = len(data["simulations"])
                        if count != shown:
                            shown = count
                            print(self.line(data), file=self.out, flush=True)
                            last_print = time.monotonic()
            if time.monotonic() - last_print >= self.every and self.last_good is not None:
                print(self.line(json.loads(self.last_good)), file=self.out, flush=True)
                last_print = time.monotonic()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join(5)

    def repair(self) -> bool:
        """Restores the last complete version if the file is no longer valid JSON."""
        try:
            json.loads(self.path.read_text())
            return False
        except (OSError, ValueError):
            if self.last_good is None:
                return False
            self.path.write_text(self.last_good)
            return True


def summarize(results_path: Path) -> dict:
    """Each simulation's reward from tau2's results file, the mean reward and pass^1 (tau2's
    definitions: success = reward 1; pass^1 = the mean over tasks of their trials' success)."""
    data = json.loads(Path(results_path).read_text())
    order = {t["id"]: i for i, t in enumerate(data["tasks"])}
    rows = []
    for s in data["simulations"]:
        reward = float((s.get("reward_info") or {}).get("reward") or 0.0)
        rows.append(
            {
                "task_id": s["task_id"],
                "trial": s.get("trial"),
                "reward": reward,
                "success": abs(reward - 1.0) <= 1e-6,
                "termination": s.get("termination_reason"),
                "failed": bool(s.get("skipped")),
            }
        )
    rows.sort(key=lambda r: (order.get(r["task_id"], len(order)), r["trial"] or 0))
    by_task: dict[str, list[bool]] = {}
    for r in rows:
        by_task.setdefault(r["task_id"], []).append(r["success"])
    n = len(rows)
    return {
        "results": str(Path(results_path).resolve()),
        "domain": data["info"]["environment_info"]["domain_name"],
        "num_tasks": len(data["tasks"]),
        "num_trials": data["info"]["num_trials"],
        "num_simulations": n,
        "mean_reward": sum(r["reward"] for r in rows) / n if n else None,
        "pass^1": (sum(sum(v) / len(v) for v in by_task.values()) / len(by_task))
        if by_task
        else None,
        "failed": sum(r["failed"] for r in rows),
        "terminations": dict(Counter(r["termination"] for r in rows)),
        "simulations": rows,
    }


def print_summary(summary: dict, metrics: Path, out=None) -> None:
    out = out or sys.stdout
    print(
        f"[tau2] results saved by tau2 in {summary['results']} (rewards from its evaluator; a "
        "task that failed with an error is scored 0)",
        file=out,
    )
    if metrics.exists():
        print(f"[tau2] tau2's metrics: {metrics}", file=out)
    width = max([len("task")] + [len(str(r["task_id"])) for r in summary["simulations"]])
    print(f"  {'task':<{width}}  trial  reward  termination", file=out)
    for r in summary["simulations"]:
        note = " (failed with an error, scored 0)" if r["failed"] else ""
        print(
            f"  {r['task_id']:<{width}}  {r['trial']:>5}  {r['reward']:6.3f}  "
            f"{r['termination']}{note}",
            file=out,
        )
    if summary["num_simulations"]:
        print(
            f"[tau2] {summary['domain']}: mean reward {summary['mean_reward']:.3f}, pass^1 "
            f"{summary['pass^1']:.3f} over {summary['num_simulations']} simulations of "
            f"{summary['num_tasks']} tasks ({summary['failed']} failed with an error)",
            file=out,
            flush=True,
        )


_CALLS_RE = re.compile(re.escape(CALLS) + r"((?: \w+=\d+)+)")


def parse_calls(line: str) -> tuple[dict[str, int] | None, str]:
    """(the counts of a launcher's `CALLS` report in line, or None; the rest of the line)."""
    m = _CALLS_RE.search(line)
    if m is None:
        return None, line
    counts = {k: int(v) for k, v in (w.split("=", 1) for w in m.group(1).split())}
    return counts, line[: m.start()] + line[m.end() :]
