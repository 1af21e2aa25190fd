"""The train job's report in its workdir: curves.png, summary.md and summary.json."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Sequence

from envace_jax.runtime.metrics import plot_curves, read_metrics, table
from envace_jax.train.evaluation import ChecklistEval, EvalResult

CURVES = [
    ("rl", "rollout_reward", "rollout reward (train)"),
    ("eval", "success", "real-env success (held out)"),
    ("eval", "fidelity", "rehearsal fidelity (held out)"),
]
CHECKLIST_CURVES = [
    ("rl", "rollout_reward", "rollout reward (train)"),
    ("eval", "checklist_avg", "checklist score avg@k (held out)"),
    ("eval", "checklist_pass", "checklist score pass@k (held out)"),
]
OUTPUTS = "metrics.jsonl, tensorboard/, curves.png, summary.md, summary.json, checkpoints/, export/"


def summary_record(ev: EvalResult | ChecklistEval, env_calls_rl: int) -> dict[str, float]:
    """The headline numbers of one evaluation, as summary.json keeps them, with the real
    environment calls that RL made before it."""
    if isinstance(ev, ChecklistEval):
        k = ev.k
        return {
            f"checklist_avg@{k}": ev.checklist_avg,
            f"checklist_avg@{k}_se": ev.checklist_avg_se,
            f"checklist_pass@{k}": ev.checklist_pass,
            f"checklist_pass@{k}_se": ev.checklist_pass_se,
            f"won_avg@{k}": ev.won_avg,
            f"won_pass@{k}": ev.won_pass,
            "invalid_rate": ev.invalid_rate,
            "judge_error_share": ev.judge_error_share,
            "env_calls_rl": env_calls_rl,
            f"checklist_avg@{k}_by_source": ev.by_source,
            f"checklist_pass@{k}_by_source": ev.by_source_pass,
        }
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


def _pm(v: float, se: float) -> str:
    return f"{v:.3f} ± {se:.3f}"


def checklist_tables(warm: ChecklistEval | None, final: ChecklistEval, trained: str) -> str:
    """summary.md without an environment: the checklist score's avg@k and pass@k with their
    standard errors, then per data source."""
    k = final.k
    evals = ([("warm start (SFT)", warm)] if warm else []) + [(trained, final)]
    header = ["policy", f"checklist avg@{k}", f"checklist pass@{k}", f"won avg@{k}"]
    header += [f"won pass@{k}", "invalid", "judge errors"]
    rows = [
        [
            name,
            _pm(ev.checklist_avg, ev.checklist_avg_se),
            _pm(ev.checklist_pass, ev.checklist_pass_se),
            ev.won_avg,
            ev.won_pass,
            ev.invalid_rate,
            ev.judge_error_share,
        ]
        for name, ev in evals
    ]
    text = table(rows, header)
    if sources := sorted({s for _, ev in evals for s in ev.by_source}):
        names = [n.split(" (")[0] for n, _ in evals]
        header = ["data source"] + [f"{n} {m}@{k}" for n in names for m in ("avg", "pass")]
        rows = [
            [src] + [d.get(src, "-") for _, ev in evals for d in (ev.by_source, ev.by_source_pass)]
            for src in sources
        ]
        text += "\n\nChecklist score by data source:\n\n" + table(rows, header)
    return text


def summary_tables(warm, final, trained: str, tasks) -> str:
    """summary.md: the headline table (greedy and avg@4 with their standard errors), then
    success per task family; the warm start's columns only when it was evaluated. A checklist
    evaluation (no environment) gets `checklist_tables`."""
    if isinstance(final, ChecklistEval):
        return checklist_tables(warm, final, trained)
    pm = _pm
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
    warm: EvalResult | ChecklistEval | None,
    final: EvalResult | ChecklistEval,
    trained: str,
    mode: str,
    tasks: Sequence,
    seconds: float,
    times: dict[str, float] | None = None,
) -> None:
    """Writes the curves and the summary of a finished train job, and prints the summary;
    `trained` names the final evaluation's row. `warm` is None when the warm start was not
    evaluated (`schedule.eval_warm_start`). `times`: seconds by part of this run (build, warm
    start, RL steps, each evaluation), written to summary.json and printed."""
    metrics = read_metrics(metrics_path)
    checklist = isinstance(final, ChecklistEval)
    curves = CHECKLIST_CURVES if checklist else CURVES
    plot_curves(metrics, os.path.join(workdir, "curves.png"), curves)
    env_calls = int(sum(m.get("env_calls", 0) for m in metrics if m.get("phase") == "rl"))
    summary = summary_tables(warm, final, trained, tasks)
    summary += f"\n\nReal-environment calls during RL: {env_calls}"
    summary_json = {
        "tasks": len(tasks),
        "mode": mode,
        "warm_start": warm and summary_record(warm, 0),
        "final": summary_record(final, env_calls),
        "seconds": {"total": round(seconds, 1), **(times or {})},
    }
    with open(os.path.join(workdir, "summary.md"), "w") as f:
        f.write(summary + "\n")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary_json, f, indent=1)
    what = "checklist evaluation, no environment" if checklist else "real-environment evaluation"
    print(f"\nHeld-out {what} ({len(tasks)} tasks):\n{summary}")
    print(f"\nworkdir: {workdir} ({OUTPUTS})")
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.0f}s" for k, v in (times or {}).items())
    print(f"total time {seconds:.0f}s" + (f" ({parts})" if parts else ""))
