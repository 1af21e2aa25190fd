"""The train job's report in its workdir: curves.png, summary.md and summary.json."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Sequence

from envace_jax.evaluation import EvalResult
from envace_jax.metrics import plot_curves, read_metrics, table

CURVES = [
    ("rl", "rollout_reward", "rollout reward (train)"),
    ("eval", "success", "real-env success (held out)"),
    ("eval", "fidelity", "rehearsal fidelity (held out)"),
]
OUTPUTS = "metrics.jsonl, tensorboard/, curves.png, summary.md, summary.json, checkpoints/, export/"


def summary_record(ev: EvalResult, env_calls_rl: int) -> dict[str, float]:
    """The headline numbers of one evaluation, as summary.json keeps them, with the real
    environment calls that RL made before it."""
    return {
        "success_greedy": ev.success,
        "success_greedy_se": ev.success_se,
        "success_avg4": ev.success_avg4,
        "success_avg4_se": ev.success_avg4_se,
        "reward": ev.reward,
        "fidelity": ev.fidelity,
        "env_calls_rl": env_calls_rl,
        "success_greedy_by_stratum": ev.by_stratum,
        "success_avg4_by_stratum": ev.by_stratum_avg4,
    }


def summary_tables(warm: EvalResult | None, final: EvalResult, trained: str, tasks) -> str:
    """summary.md: the headline table (greedy and avg@4 with their standard errors), then
    success per task family; the warm start's columns only when it was evaluated."""
    pm = lambda v, se: f"{v:.3f} ± {se:.3f}"
    header = ["policy", "success (greedy)", "success (avg@4)", "reward", "tool errors"]
    header += ["invalid", "fidelity"]
    evals = ([("warm start (SFT)", warm)] if warm else []) + [(trained, final)]
    rows = [
        [
            name,
            pm(ev.success, ev.success_se),
            pm(ev.success_avg4, ev.success_avg4_se),
            ev.reward,
            ev.tool_error_rate,
            ev.invalid_rate,
            ev.fidelity,
        ]
        for name, ev in evals
    ]
    text = table(rows, header)
    names = (["warm start"] if warm else []) + [trained]
    groups = (("stratum", "by_stratum", "stratum"), ("task family", "by_family", "family"))
    for title, field, key in groups:
        if not (found := sorted({f for _, ev in evals for f in getattr(ev, field)})):
            continue
        counts = collections.Counter(t.metadata.get(key) for t in tasks)
        pairs = [(getattr(ev, field), getattr(ev, field + "_avg4")) for _, ev in evals]
        rows = [[f, counts[f]] + [d.get(f, "-") for pair in pairs for d in pair] for f in found]
        header = [title, "tasks"] + [f"{n} {k}" for n in names for k in ("greedy", "avg@4")]
        text += f"\n\nSuccess by {title}:\n\n" + table(rows, header)
    return text


def write_report(
    workdir: str,
    metrics_path: str,
    warm: EvalResult | None,
    final: EvalResult,
    trained: str,
    mode: str,
    tasks: Sequence,
    seconds: float,
) -> None:
    """Writes the curves and the summary of a finished train job, and prints the summary;
    `trained` names the final evaluation's row. `warm` is None when the warm start was not
    evaluated (`schedule.eval_warm_start`)."""
    metrics = read_metrics(metrics_path)
    plot_curves(metrics, os.path.join(workdir, "curves.png"), CURVES)
    env_calls = int(sum(m.get("env_calls", 0) for m in metrics if m.get("phase") == "rl"))
    summary = summary_tables(warm, final, trained, tasks)
    summary += f"\n\nReal-environment calls during RL: {env_calls}"
    summary_json = {
        "tasks": len(tasks),
        "mode": mode,
        "warm_start": warm and summary_record(warm, 0),
        "final": summary_record(final, env_calls),
    }
    with open(os.path.join(workdir, "summary.md"), "w") as f:
        f.write(summary + "\n")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary_json, f, indent=1)
    print(f"\nHeld-out real-environment evaluation ({len(tasks)} tasks):\n{summary}")
    print(f"\nworkdir: {workdir} ({OUTPUTS})")
    print(f"total time {seconds:.0f}s")
