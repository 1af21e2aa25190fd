"""The comparison's verdicts: per-arm means over seeds, paired differences with their standard
errors, each claim's verdict per stratum, the sensitivity bars, and the tables and plot of
`results.md` / `results.png`.
"""

from __future__ import annotations

import csv
import json
import math
from typing import Any

import numpy as np

from envace_jax.runtime.metrics import verdict

# The comparison's arms: name -> the config keys that make it (every other key is the base's).
ARMS: dict[str, dict[str, Any]] = {
    "sft_only": {"mode": "sft_only"},
    "envace_grounded": {"mode": "envace", "rollout.rehearsal_view": "grounded"},
    "envace": {"mode": "envace", "rollout.rehearsal_view": "shared"},
    "envace_noshare": {"mode": "envace_noshare", "rollout.rehearsal_view": "shared"},
    "external_simulator": {"mode": "external_simulator", "rollout.rehearsal_view": "shared"},
    "grpo_real_env": {"mode": "grpo_real_env"},
    "redrawn": {"mode": "corrupted_world", "rollout.corruption": "redrawn"},
    "optimist": {"mode": "corrupted_world", "rollout.corruption": "optimist"},
    "guesser": {"mode": "corrupted_world", "rollout.corruption": "guesser"},
    "blind": {"mode": "corrupted_world", "rollout.corruption": "blind"},
    "liar": {"mode": "corrupted_world", "rollout.corruption": "liar"},
}
# Held-out scores of each run (`train.evaluation`): success greedy and avg@4, and the rest.
METRICS = ("success", "success_avg4", "reward", "fidelity", "tool_error_rate", "invalid_rate")
# Where a claim is judged: all tasks, and each stratum (`envs.demo.tasks`), whose success a
# run's evaluation writes as `stratum_success[_avg4]/<stratum>`.
SCOPES = ("all", "hidden", "visible")
# (claim, arm a, arm b): the claim is that a's success is above b's.
CLAIMS = (
    (
        "a world with redrawn hidden state teaches less than the real one",
        "grpo_real_env",
        "redrawn",
    ),
    ("a world that never refuses teaches less than the real one", "grpo_real_env", "optimist"),
    (
        "a world that guesses hidden state and never refuses teaches less than the real one",
        "grpo_real_env",
        "guesser",
    ),
    (
        "a world that contradicts the state the context shows teaches less than the real one",
        "grpo_real_env",
        "blind",
    ),
    ("a world that is consistently wrong teaches less than the real one", "grpo_real_env", "liar"),
    ("RL in the real environment improves on the warm start", "grpo_real_env", "sft_only"),
    ("grounded rehearsal beats the redrawn world", "envace_grounded", "redrawn"),
    ("grounded rehearsal beats the guessing world", "envace_grounded", "guesser"),
    ("grounded rehearsal beats the blind world", "envace_grounded", "blind"),
    ("grounded rehearsal beats the lying world", "envace_grounded", "liar"),
    ("grounded rehearsal beats an external simulator", "envace_grounded", "external_simulator"),
    ("grounded rehearsal beats RL in the real environment", "envace_grounded", "grpo_real_env"),
    ("grounded rehearsal beats shared rehearsal", "envace_grounded", "envace"),
    ("sharing parameters between the roles helps", "envace", "envace_noshare"),
    *(
        (f"RL by {arm} improves on the warm start", arm, "sft_only")
        for arm in ("envace_grounded", "envace", "envace_noshare", "external_simulator")
    ),
)
# The sensitivity bars (points of avg@4, and paired standard errors): a comparison that can
# tell a right world from a wrong one shows real-environment GRPO above a wrong world. Every
# corrupted world is held to the bars; the ones wrong only where the context is silent need
# not meet them (`envs.demo.corrupt`).
SENSITIVITY = (
    ("grpo_real_env", "redrawn", "all", 0.05),
    ("grpo_real_env", "redrawn", "hidden", 0.10),
    ("grpo_real_env", "guesser", "all", 0.05),
    ("grpo_real_env", "guesser", "hidden", 0.10),
    ("grpo_real_env", "blind", "all", 0.05),
    ("grpo_real_env", "blind", "hidden", 0.10),
    ("grpo_real_env", "liar", "all", 0.05),
    ("grpo_real_env", "liar", "hidden", 0.10),
    ("grpo_real_env", "sft_only", "all", 0.15),
)
SENSITIVITY_SE = 3.0


def scoped(key: str, scope: str) -> str:
    """The result key of metric `key` ('success' or 'success_avg4') in `scope`."""
    return key if scope == "all" else f"stratum_{key}/{scope}"


def summarize(results: list[dict[str, Any]]) -> dict[str, dict]:
    """arm -> mean and std (over seeds) of each metric, per-seed success in every scope, and
    totals."""
    out = {}
    scoped_keys = [scoped(k, s) for s in SCOPES[1:] for k in ("success", "success_avg4")]
    for arm in ARMS:
        rs = [r for r in results if r["mode"] == arm]
        if not rs:
            continue
        s = {"n": len(rs), "params": rs[0]["params"]}
        for k in (*METRICS, *scoped_keys, "rl_tokens", "rl_seconds"):
            v = np.asarray([r.get(k, np.nan) for r in rs], np.float64)
            s[k], s[k + "_std"] = float(v.mean()), float(v.std(ddof=1) if len(v) > 1 else 0.0)
        for k in ("success", "success_avg4", *scoped_keys):
            s[k + "_by_seed"] = {r["seed"]: float(r.get(k, np.nan)) for r in rs}
        out[arm] = s
    return out


def compare_means(a: dict, b: dict, key: str = "success") -> tuple[float, float, str]:
    """Difference of means a - b, its standard error, and a verdict: 'supported' when the
    difference exceeds twice its standard error, 'contradicted' when it is below minus twice
    it, else 'not resolved' (the difference is within seed noise).

    Runs with the same seed share the warm start and the held-out tasks, so when both arms ran
    the same seeds the difference is taken seed by seed (paired): its standard error is the
    std of the per-seed differences over sqrt(n), free of how hard each seed's tasks happen to
    be. Otherwise the two means' errors add."""
    pa, pb = a.get(key + "_by_seed"), b.get(key + "_by_seed")
    if pa and pb and set(pa) == set(pb) and len(pa) > 1:
        diffs = np.asarray([pa[s] - pb[s] for s in sorted(pa)], np.float64)
        d, se = float(diffs.mean()), float(diffs.std(ddof=1) / math.sqrt(len(diffs)))
    else:
        d = a[key] - b[key]
        se = math.sqrt(a[key + "_std"] ** 2 / a["n"] + b[key + "_std"] ** 2 / b["n"])
    return d, se, verdict(d, se)


def claims(summary) -> list[tuple[str, str, str, str]]:
    """(claim, scope, measured numbers, verdict) for each claim whose arms ran, in each scope
    the runs report; judged on avg@4, with greedy shown beside it."""
    out = []
    for claim, a, b in CLAIMS:
        if a not in summary or b not in summary:
            continue
        for scope in SCOPES:
            key = scoped("success_avg4", scope)
            if math.isnan(summary[a][key]) or math.isnan(summary[b][key]):
                continue
            d, se, v = compare_means(summary[a], summary[b], key)
            dg, seg, _ = compare_means(summary[a], summary[b], scoped("success", scope))
            text = f"{a} - {b}: avg@4 {d:+.3f} (s.e. {se:.3f}), greedy {dg:+.3f} (s.e. {seg:.3f})"
            out.append((claim, scope, text, v))
    return out


def sensitivity(summary) -> list[tuple[str, str, float, float, float, bool]]:
    """(a, b, scope, difference, s.e., met) for each bar of `SENSITIVITY` whose arms ran: the
    paired avg@4 difference is at least the bar and at least `SENSITIVITY_SE` standard
    errors."""
    out = []
    for a, b, scope, bar in SENSITIVITY:
        if a in summary and b in summary:
            key = scoped("success_avg4", scope)
            d, se, _ = compare_means(summary[a], summary[b], key)
            out.append((a, b, scope, d, se, d >= bar and d >= SENSITIVITY_SE * se, bar))
    return out


def _pm(s: dict, k: str) -> str:
    return f"{s[k]:.3f} ± {s[k + '_std']:.3f}"


def results_markdown(summary, verdicts, bars, budget: str, overrides, seeds, minutes) -> str:
    header = (
        "| arm | success avg@4 | greedy | avg@4 hidden | avg@4 visible | reward | fidelity | "
        "tool errors | invalid | RL tokens | RL time (s) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {arm} | {_pm(s, 'success_avg4')} | {_pm(s, 'success')} | "
        f"{_pm(s, scoped('success_avg4', 'hidden'))} | "
        f"{_pm(s, scoped('success_avg4', 'visible'))} | {_pm(s, 'reward')} | "
        f"{_pm(s, 'fidelity')} | {_pm(s, 'tool_error_rate')} | {_pm(s, 'invalid_rate')} | "
        f"{s['rl_tokens']:,.0f} | {s['rl_seconds']:.0f} |"
        for arm, s in summary.items()
    ]
    params = next(iter(summary.values()))["params"] if summary else 0
    parts = [
        "# Arm comparison on the demo domain",
        "",
        f"Budget `{budget}` (seeds {', '.join(map(str, seeds))}; mean ± std over seeds; held-out "
        f"test tasks in the real environment). Policy of {params:,} parameters. Wall time of "
        f"the runs: {minutes:.1f} min.",
        "",
        f"Overrides on the base config, the same for every run: `{json.dumps(overrides)}`.",
        "",
        header,
        "\n".join(rows),
        "",
        "## Sensitivity: can the comparison tell a right world from a wrong one?",
        "",
        f"A bar is met when the paired avg@4 difference is at least the bar and at least "
        f"{SENSITIVITY_SE:g} standard errors.",
        "",
        "| difference | scope | measured | bar | met |",
        "|---|---|---|---|---|",
    ]
    parts += [
        f"| {a} - {b} | {scope} | {d:+.3f} (s.e. {se:.3f}) | {bar:+.2f} | {('no', 'yes')[met]} |"
        for a, b, scope, d, se, met, bar in bars
    ]
    parts += [
        "",
        "## Claims",
        "",
        "A claim is *supported* when the avg@4 success difference exceeds twice its standard error "
        "over seeds, *contradicted* when it is below minus twice it, and *not resolved* "
        "otherwise. Arms are compared seed by seed (a seed's runs share the warm start and the "
        "held-out tasks).",
        "",
        "| claim | tasks | measured | verdict |",
        "|---|---|---|---|",
    ]
    parts += [f"| {c} | {scope} | {m} | {v} |" for c, scope, m, v in verdicts]
    return "\n".join(parts) + "\n"


def write_csv(path: str, results: list[dict[str, Any]]) -> None:
    keys = ["mode", "seed", "params", *METRICS]
    keys += [scoped(k, s) for s in SCOPES[1:] for k in ("success", "success_avg4")]
    keys += ["rl_steps", "rl_tokens", "rl_seconds", "seconds"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(results)


def plot(path: str, summary, results) -> None:
    """avg@4 success per arm on all tasks and on each stratum: bars are seed means, whiskers
    the std, dots the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    fig, axes = plt.subplots(1, len(SCOPES), figsize=(5 * len(SCOPES), 4), sharey=True)
    for ax, scope in zip(axes, SCOPES, strict=True):
        key = scoped("success_avg4", scope)
        means = [summary[m][key] for m in arms]
        stds = [summary[m][key + "_std"] for m in arms]
        ax.bar(range(len(arms)), means, yerr=stds, capsize=4, color="tab:blue", alpha=0.7)
        for i, m in enumerate(arms):
            ys = [r.get(key, np.nan) for r in results if r["mode"] == m]
            ax.plot([i] * len(ys), ys, "k.", markersize=5)
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        ax.set_title(f"held-out success (avg@4), {scope} tasks")
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
