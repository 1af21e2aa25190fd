"""The comparison's verdicts: per-mode means over seeds, paired differences with their
standard errors, each claim's verdict, and the tables and plot of `results.md` / `results.png`.
"""

from __future__ import annotations

import csv
import json
import math
from typing import Any

import numpy as np

# Policy sizes of the scale study: name -> model preset. The first is the main comparison's; it
# keeps the config's model (the demo's starts from the shipped demo base), other sizes start
# from random init.
SIZES = {"main": "demo-qwen3", "small": "tiny-qwen3"}
# Modes run at the other sizes: the scaling claim compares EnvACE with its warm start and with
# standard RL in the real environment.
SCALE_MODES = ("sft_only", "envace", "grpo_real_env")
# The comparison's arms: name -> (training mode, rehearsal view where the mode rehearses).
ARMS = {
    "sft_only": ("sft_only", None),
    "envace": ("envace", "shared"),
    "envace_grounded": ("envace", "grounded"),
    "envace_noshare": ("envace_noshare", "shared"),
    "external_simulator": ("external_simulator", "shared"),
    "grpo_real_env": ("grpo_real_env", None),
}
# Held-out scores of each run (`envace_jax.evaluation`): success greedy and avg@4, and the rest.
METRICS = ("success", "success_avg4", "reward", "fidelity", "tool_error_rate", "invalid_rate")


def summarize(results: list[dict[str, Any]], sizes=SIZES) -> dict[tuple[str, str], dict]:
    """(size, arm) -> mean and std (over seeds) of each metric, and totals."""
    out = {}
    for size in sizes:
        for mode in ARMS:
            rs = [r for r in results if r["size"] == size and r["mode"] == mode]
            if not rs:
                continue
            s = {"n": len(rs), "params": rs[0]["params"]}
            for k in (*METRICS, "rl_tokens", "rl_seconds"):
                v = np.asarray([r[k] for r in rs], np.float64)
                s[k], s[k + "_std"] = float(v.mean()), float(v.std(ddof=1) if len(v) > 1 else 0.0)
            for k in ("success", "success_avg4"):
                s[k + "_by_seed"] = {r["seed"]: float(r[k]) for r in rs}
            out[(size, mode)] = s
    return out


def compare_means(a: dict, b: dict, key: str = "success") -> tuple[float, float, str]:
    """Difference of means a - b, its standard error, and a verdict: 'supported' when the
    difference exceeds twice its standard error, 'contradicted' when it is below minus twice
    it, else 'not resolved' (the difference is within seed noise).

    Runs of one size with the same seed share the warm start and the held-out tasks, so when
    both modes ran the same seeds the difference is taken seed by seed (paired): its standard
    error is the std of the per-seed differences over sqrt(n), free of how hard each seed's
    tasks happen to be. Otherwise (different seeds or sizes) the two means' errors add."""
    pa, pb = a.get(key + "_by_seed"), b.get(key + "_by_seed")
    if pa and pb and set(pa) == set(pb) and len(pa) > 1:
        diffs = np.asarray([pa[s] - pb[s] for s in sorted(pa)], np.float64)
        d, se = float(diffs.mean()), float(diffs.std(ddof=1) / math.sqrt(len(diffs)))
    else:
        d = a[key] - b[key]
        se = math.sqrt(a[key + "_std"] ** 2 / a["n"] + b[key + "_std"] ** 2 / b["n"])
    return d, se, _verdict(d, se)


def _verdict(d: float, se: float) -> str:
    """'supported' beyond twice the standard error, 'contradicted' below minus twice it."""
    if d > 2 * se and d > 0:
        return "supported"
    if d < -2 * se and d < 0:
        return "contradicted"
    return "not resolved"


def claims(summary, sizes=SIZES) -> list[tuple[str, str, str]]:
    """(claim, measured numbers, verdict) for each claim of the paper that the runs test."""
    main, small = (list(sizes) + [None])[:2]
    get = lambda size, mode: summary.get((size, mode))
    out = []
    pairs = [
        ("RL in the real environment improves on the warm start", "grpo_real_env", "sft_only"),
        ("world rehearsal beats standard RL in the real environment", "envace", "grpo_real_env"),
        (
            "world rehearsal beats training against an external simulator",
            "envace",
            "external_simulator",
        ),
        ("sharing parameters between the roles helps", "envace", "envace_noshare"),
        ("RL by world rehearsal improves on the warm start", "envace", "sft_only"),
        (
            "RL by grounded world rehearsal improves on the warm start",
            "envace_grounded",
            "sft_only",
        ),
        ("grounded rehearsal beats shared rehearsal", "envace_grounded", "envace"),
        (
            "grounded rehearsal beats training against an external simulator",
            "envace_grounded",
            "external_simulator",
        ),
    ]
    for claim, a, b in pairs:
        if get(main, a) and get(main, b):
            d, se, v = compare_means(get(main, a), get(main, b), "success_avg4")
            dg, seg, _ = compare_means(get(main, a), get(main, b), "success")
            text = f"{a} - {b}: avg@4 {d:+.3f} (s.e. {se:.3f}), greedy {dg:+.3f} (s.e. {seg:.3f})"
            out.append((claim, text, v))
    grounded, real, warm = (get(main, a) for a in ("envace_grounded", "grpo_real_env", "sft_only"))
    if grounded and real and warm:
        out.append(_gain_share(grounded, real, warm, 0.7))
    gains = {}
    for size in (main, small) if small else (main,):
        if get(size, "envace") and get(size, "grpo_real_env"):
            gains[size] = compare_means(
                get(size, "envace"), get(size, "grpo_real_env"), "success_avg4"
            )
    if len(gains) == 2:
        (d_big, se_big, _), (d_small, se_small, _) = gains[main], gains[small]
        diff = d_big - d_small
        se = math.sqrt(se_big**2 + se_small**2)
        # A size that solves nothing after its warm start has no gain to measure.
        floor = [
            z
            for z in (main, small)
            if get(z, "sft_only") and not get(z, "sft_only")["success_avg4"]
        ]
        if floor:
            v = f"not testable: the {sizes[floor[0]]} warm start solves no held-out task"
        else:
            v = _verdict(diff, se)
        text = (
            f"gain over grpo_real_env: {sizes[main]} {d_big:+.3f}, {sizes[small]} {d_small:+.3f}; "
            f"difference {diff:+.3f} (s.e. {se:.3f})"
        )
        out.append(("the gain of world rehearsal grows with model size", text, v))
    return out


def _gain_share(a: dict, b: dict, base: dict, share: float) -> tuple[str, str, str]:
    """Whether arm `a`'s avg@4 gain over `base` is at least `share` x arm `b`'s: judged on
    (a - base) - share (b - base) = (a - share b) - (1 - share) base, seed by seed."""
    key = "success_avg4"
    weights = (1.0, -share, share - 1.0)
    mixed = {
        "n": a["n"],
        key: sum(w * x[key] for w, x in zip(weights, (a, b, base), strict=True)),
        key + "_std": math.sqrt(
            sum((w * x[key + "_std"]) ** 2 for w, x in zip(weights, (a, b, base), strict=True))
        ),
    }
    by_seed = [x.get(key + "_by_seed") or {} for x in (a, b, base)]
    seeds = set(by_seed[0]) & set(by_seed[1]) & set(by_seed[2])
    mixed[key + "_by_seed"] = {
        s: sum(w * x[s] for w, x in zip(weights, by_seed, strict=True)) for s in seeds
    }
    zero = {"n": a["n"], key: 0.0, key + "_std": 0.0, key + "_by_seed": dict.fromkeys(seeds, 0.0)}
    d, se, v = compare_means(mixed, zero, key)
    ga, gb = a[key] - base[key], b[key] - base[key]
    ratio = f"{ga / gb:.2f}" if gb else "undefined"
    text = (
        f"gains over sft_only: envace_grounded {ga:+.3f}, grpo_real_env {gb:+.3f} (ratio "
        f"{ratio}); gain - {share} x gain {d:+.3f} (s.e. {se:.3f})"
    )
    return (
        f"grounded rehearsal gains at least {share} x what RL in the real environment gains",
        text,
        v,
    )


def _pm(s: dict, k: str) -> str:
    return f"{s[k]:.3f} ± {s[k + '_std']:.3f}"


def _results(summary, size, modes) -> list[tuple[str, dict]]:
    """(mode, summary) of each of `modes` that has runs of `size`, in the order of `modes`."""
    return [(mode, summary[(size, mode)]) for mode in modes if summary.get((size, mode))]


def results_markdown(
    summary, verdicts, budget: str, overrides, seeds: int, minutes: float, sizes=SIZES
) -> str:
    main = next(iter(sizes))
    header = (
        "| mode | success (avg@4) | success (greedy) | reward | rehearsal fidelity | "
        "tool-error rate | invalid | tokens processed (RL) | RL wall time (s) |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )

    rows = [
        f"| {mode} | {_pm(s, 'success_avg4')} | {_pm(s, 'success')} | {_pm(s, 'reward')} | "
        f"{_pm(s, 'fidelity')} | {_pm(s, 'tool_error_rate')} | "
        f"{_pm(s, 'invalid_rate')} | {s['rl_tokens']:,.0f} | {s['rl_seconds']:.0f} |"
        for mode, s in _results(summary, main, ARMS)
    ]
    params = summary[(main, "sft_only")]["params"] if (main, "sft_only") in summary else 0
    parts = [
        "# Mode comparison on the demo domain",
        "",
        f"Budget `{budget}` ({seeds} seeds per mode, mean ± std over seeds; held-out tasks in "
        f"the real environment). Policy `{sizes[main]}` ({params:,} parameters). Wall time of "
        f"the runs: {minutes:.1f} min.",
        "",
        f"Overrides on the base config, the same for every run: `{json.dumps(overrides)}`.",
        "",
        header,
        "\n".join(rows),
    ]
    if len(sizes) > 1:
        parts += [
            "",
            "## Model-scale study",
            "",
            "| size | parameters | mode | success (avg@4) | reward | rehearsal fidelity |",
            "|---|---|---|---|---|---|",
        ]
    for size, preset in sizes.items() if len(sizes) > 1 else ():
        parts += [
            f"| {preset} | {s['params']:,} | {mode} | {_pm(s, 'success_avg4')} | "
            f"{_pm(s, 'reward')} | {_pm(s, 'fidelity')} |"
            for mode, s in _results(summary, size, SCALE_MODES)
        ]
    parts += [
        "",
        "## The paper's claims",
        "",
        "A claim is *supported* when the avg@4 success difference exceeds twice its standard error "
        "over seeds, *contradicted* when it is below minus twice it, and *not resolved* "
        "otherwise. Modes of one size are compared seed by seed (a seed's runs share the warm "
        "start and the held-out tasks); the scale claim's two gains are independent.",
        "",
        "| claim | measured | verdict |",
        "|---|---|---|",
    ]
    parts += [f"| {c} | {m} | {v} |" for c, m, v in verdicts]
    return "\n".join(parts) + "\n"


def write_csv(path: str, results: list[dict[str, Any]]) -> None:
    keys = ["size", "preset", "params", "mode", "seed", *METRICS]
    keys += ["rl_steps", "rl_tokens", "rl_seconds", "seconds"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(results)


def plot(path: str, summary, results, sizes=SIZES) -> None:
    """Success avg@4 and greedy per mode (main size), and avg@4 per size in the scale study:
    bars are seed means, whiskers the std, dots the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = next(iter(sizes))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    modes = [m for m in ARMS if (main, m) in summary]
    for ax, key in zip(axes[:2], ("success_avg4", "success"), strict=True):
        means = [summary[(main, m)][key] for m in modes]
        stds = [summary[(main, m)][key + "_std"] for m in modes]
        ax.bar(range(len(modes)), means, yerr=stds, capsize=4, color="tab:blue", alpha=0.7)
        for i, m in enumerate(modes):
            ys = [r[key] for r in results if r["size"] == main and r["mode"] == m]
            ax.plot([i] * len(ys), ys, "k.", markersize=5)
        ax.set_xticks(range(len(modes)), modes, rotation=20, ha="right")
        name = "success (avg@4)" if key == "success_avg4" else "success (greedy)"
        ax.set_title(f"held-out {name} ({sizes[main]})")
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
    ax = axes[2]
    width = 0.8 / len(sizes)
    for j, (size, preset) in enumerate(sizes.items()):
        ms = [summary.get((size, m)) for m in SCALE_MODES]
        xs = np.arange(len(SCALE_MODES)) + (j - (len(sizes) - 1) / 2) * width
        ax.bar(
            xs,
            [s["success_avg4"] if s else 0 for s in ms],
            width,
            yerr=[s["success_avg4_std"] if s else 0 for s in ms],
            capsize=3,
            label=preset,
        )
    ax.set_xticks(range(len(SCALE_MODES)), SCALE_MODES)
    ax.set_title("held-out success (avg@4) by policy size")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
