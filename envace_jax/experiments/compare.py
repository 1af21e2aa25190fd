"""Mini-replication of the paper's comparison on the demo domain.

    python -m envace_jax.experiments.compare --workdir DIR            # full (up to ~60 min)
    python -m envace_jax.experiments.compare --workdir DIR --quick    # quick (up to ~15 min)
    python -m envace_jax.experiments.compare --workdir DIR --set rollout.group_size=8  # any key
    python -m envace_jax.experiments.compare --workdir DIR --modes sft_only,grpo_real_env

Every training mode (`rollout.modes`, or those `--modes` names) x 3 seeds, with the same budget,
on the main policy size; with a second `--presets` entry, a model-scale study: the modes that
carry the scaling claim, on a smaller policy. Every run is evaluated the same way (greedy and
avg@4 on 256 held-out tasks, `envace_jax.evaluation`), and claims are judged on avg@4. Writes
`results.md` (tables and the claim-by-claim verdicts), `results.csv` (one line per run) and
`results.png` (bars) into DIR; each run keeps its own workdir under DIR/runs/.

Protocol (the same for every mode, nothing tuned per mode or on held-out tasks):
* base config: `configs/demo.py` (`--config`), then the budget (`BUDGETS`), then `--set`s;
* one warm start per policy size (mode 'sft_only', seed 0), shared by every mode and seed:
  each RL run loads it (`schedule.warm_start_dir`) and takes the same number of optimizer
  steps with the same rollouts per step;
* a seed picks the held-out tasks, the RL task order and the sampling; 'sft_only' with seed s
  is the warm start evaluated on seed s's held-out tasks.
A run that finished is not run again (its `result.json` is read back), and an interrupted run
resumes from its checkpoints, so the command can be re-run after a stop.
"""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import math
import os
import sys
import time
from typing import Any

import ml_collections
import numpy as np
from absl import app, flags, logging

from envace_jax.configuration import MODES, validate
from envace_jax.metrics import read_metrics

# Policy sizes of the scale study: name -> model preset. The first is the main comparison's; it
# keeps the config's model (the demo's starts from the shipped demo base), other sizes start
# from random init.
SIZES = {"main": "demo-qwen3", "small": "tiny-qwen3"}
# Modes run at the other sizes: the scaling claim compares EnvACE with its warm start and with
# standard RL in the real environment.
SCALE_MODES = ("sft_only", "envace", "grpo_real_env")
SEEDS = (0, 1, 2)

# Per-run overrides, the same for every mode. `full` keeps the demo config's warm start and its
# RL steps and learning-rate schedule (with 6 steps the 4-step warmup left RL too little to
# change a greedy policy: most modes ended where they started), with a quarter of its rollouts
# per step so that 4 RL modes x 3 seeds fit the time; `quick` also shortens the warm start
# (its numbers check the pipeline more than the claims).
BUDGETS: dict[str, dict[str, Any]] = {
    "full": {
        "rollout.tasks_per_step": 4,
        "rollout.group_size": 4,
        "data.eval_tasks": 256,
        "eval.fidelity_tasks": 16,
    },
    "quick": {
        "schedule.sft_steps": 60,
        "sft_optim.warmup_steps": 6,
        "sft_optim.decay_steps": 60,
        "schedule.rl_steps": 2,
        "rollout.tasks_per_step": 2,
        "rollout.group_size": 4,
        "data.eval_tasks": 8,
        "eval.fidelity_tasks": 4,
    },
}
# Bookkeeping the same in every run: evaluate at the end only, checkpoint rarely.
_COMMON = {
    "schedule.eval_every": 0,
    "schedule.checkpoint_every": 1000,
    "schedule.keep_checkpoints": 1,
    "schedule.log_every": 20,
}
# Held-out scores of each run (`envace_jax.evaluation`): success greedy and avg@4, and the rest.
METRICS = ("success", "success_avg4", "reward", "fidelity", "tool_error_rate", "invalid_rate")

_REPO_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "configs",
    "demo.py",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (results and per-run workdirs).")
_QUICK = flags.DEFINE_bool("quick", False, "The quick budget (BUDGETS['quick']).")
_CONFIG = flags.DEFINE_string(
    "config", _REPO_CONFIG, "Base config file (`path.py` or `path.py:variant`)."
)
_SET = flags.DEFINE_multi_string("set", [], "Override for every run, e.g. rollout.group_size=8.")
_SEEDS = flags.DEFINE_integer("seeds", len(SEEDS), "Seeds per mode.")
_PRESETS = flags.DEFINE_list(
    "presets",
    [SIZES["main"]],
    "Model presets: the main comparison's, then optionally a smaller one for the scale study.",
)
_MODES = flags.DEFINE_list("modes", list(MODES), "Training modes of the main comparison.")


# ---------------------------------------------------------------------------------- configs


def load_config(spec: str) -> ml_collections.ConfigDict:
    """`get_config(variant)` of a config file given as `path.py[:variant]`."""
    path, _, variant = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config: no file {path!r}")
    module_spec = importlib.util.spec_from_file_location("_compare_base_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant or None)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` strings -> {key: value}; values are Python literals, else strings."""
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. rollout.group_size=8")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def apply(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> None:
    for path, value in overrides.items():
        *sections, key = path.split(".")
        node = config
        for s in sections:
            node = node[s]
        if key not in node:
            raise KeyError(f"unknown config key config.{path}")
        node[key] = tuple(value) if isinstance(value, list) else value


def run_config(base, overrides: dict[str, Any], preset: str, mode: str, seed: int, warm: str):
    config = ml_collections.ConfigDict(base.to_dict())
    apply(config, overrides)
    if preset != config.model.preset:  # another size: random init (a shipped base is one size)
        config.model.hf_path = ""
    config.model.preset = preset
    config.mode = mode
    config.seed = seed
    config.schedule.warm_start_dir = warm
    return validate(config)


# ------------------------------------------------------------------------------------ runs


def run_one(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """One training run (or its saved result): final eval, RL tokens and wall time."""
    path = os.path.join(workdir, "result.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    from envace_jax.trainer import Trainer

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1)
    trainer = Trainer(config, workdir)
    params = trainer.model.cfg.num_params
    out = trainer.run()
    del trainer
    rl = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["phase"] == "rl"]
    rows = config.rollout.group_size * config.rollout.tasks_per_step
    result = {
        **out["final"],
        "rl_steps": len(rl),
        "rl_tokens": float(sum(r["rollout_tokens_mean"] * rows for r in rl)),
        "rl_seconds": float(sum(r["rollout_s"] + r["update_s"] for r in rl)),
        "seconds": out["seconds"],
        "params": params,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def plan(
    seeds: int, sizes: dict[str, str] = SIZES, modes: tuple[str, ...] = MODES
) -> list[tuple[str, str, int]]:
    """(size, mode, seed) of every run, warm starts first within each size; the scale study
    (sizes after the first) runs the `SCALE_MODES` among `modes`."""
    runs = []
    for i, size in enumerate(sizes):
        chosen = modes if i == 0 else [m for m in SCALE_MODES if m in modes]
        chosen = ("sft_only",) + tuple(m for m in chosen if m != "sft_only")
        runs += [(size, mode, seed) for mode in chosen for seed in range(seeds)]
    return runs


def run_all(
    base, overrides, root: str, seeds: int, sizes=SIZES, modes=MODES
) -> list[dict[str, Any]]:
    runs = plan(seeds, sizes, modes)
    results = []
    t0 = time.time()
    for i, (size, mode, seed) in enumerate(runs):
        warm = os.path.join(root, "runs", size, "warm_start")
        if mode == "sft_only" and seed == 0:
            workdir, warm_dir = warm, ""  # the warm start itself
        else:
            workdir, warm_dir = os.path.join(root, "runs", size, mode, f"seed{seed}"), warm
        config = run_config(base, overrides, sizes[size], mode, seed, warm_dir)
        print(f"[compare] run {i + 1}/{len(runs)}: size={size} mode={mode} seed={seed}", flush=True)
        r = run_one(config, workdir)
        results.append({"size": size, "preset": sizes[size], "mode": mode, "seed": seed, **r})
        done = time.time() - t0
        print(
            f"[compare] {i + 1}/{len(runs)} done, {done / 60:.1f} min elapsed: "
            f"success={r['success']:.3f} reward={r['reward']:.3f}",
            flush=True,
        )
    return results


# --------------------------------------------------------------------------------- summary


def summarize(results: list[dict[str, Any]], sizes=SIZES) -> dict[tuple[str, str], dict]:
    """(size, mode) -> mean and std (over seeds) of each metric, and totals."""
    out = {}
    for size in sizes:
        for mode in MODES:
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
    ]
    for claim, a, b in pairs:
        if get(main, a) and get(main, b):
            d, se, v = compare_means(get(main, a), get(main, b), "success_avg4")
            dg, seg, _ = compare_means(get(main, a), get(main, b), "success")
            text = f"{a} - {b}: avg@4 {d:+.3f} (s.e. {se:.3f}), greedy {dg:+.3f} (s.e. {seg:.3f})"
            out.append((claim, text, v))
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


def _pm(s: dict, k: str) -> str:
    return f"{s[k]:.3f} ± {s[k + '_std']:.3f}"


def results_markdown(
    summary, verdicts, budget: str, overrides, seeds: int, minutes: float, sizes=SIZES
) -> str:
    main = next(iter(sizes))
    header = (
        "| mode | success (avg@4) | success (greedy) | reward | rehearsal fidelity | "
        "tool-error rate | invalid | tokens processed (RL) | RL wall time (s) |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )

    def rows(size, modes):
        lines = []
        for mode in modes:
            s = summary.get((size, mode))
            if s:
                lines.append(
                    f"| {mode} | {_pm(s, 'success_avg4')} | {_pm(s, 'success')} | "
                    f"{_pm(s, 'reward')} | "
                    f"{_pm(s, 'fidelity')} | {_pm(s, 'tool_error_rate')} | "
                    f"{_pm(s, 'invalid_rate')} | {s['rl_tokens']:,.0f} | {s['rl_seconds']:.0f} |"
                )
        return "\n".join(lines)

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
        rows(main, MODES),
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
        for mode in SCALE_MODES:
            s = summary.get((size, mode))
            if s:
                parts.append(
                    f"| {preset} | {s['params']:,} | {mode} | {_pm(s, 'success_avg4')} | "
                    f"{_pm(s, 'reward')} | {_pm(s, 'fidelity')} |"
                )
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
    modes = [m for m in MODES if (main, m) in summary]
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


# ------------------------------------------------------------------------------------ main


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    root = os.path.abspath(_WORKDIR.value)
    os.makedirs(root, exist_ok=True)
    logging.set_verbosity(logging.WARNING)  # per-step Orbax lines would bury the progress
    import jax

    # Every run compiles the same programs: a persistent cache compiles them once.
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    budget = "quick" if _QUICK.value else "full"
    try:
        if len(_PRESETS.value) not in (1, 2):
            raise ValueError(f"--presets: expected one or two model presets, got {_PRESETS.value}")
        sizes = dict(zip(SIZES, _PRESETS.value, strict=False))
        unknown = [m for m in _MODES.value if m not in MODES]
        if unknown:
            raise ValueError(f"--modes: unknown mode(s) {unknown}; known: {', '.join(MODES)}")
        base = load_config(_CONFIG.value)
        overrides = {**BUDGETS[budget], **_COMMON, **parse_overrides(_SET.value)}
        for preset in sizes.values():  # fail fast on a bad key or value
            run_config(base, overrides, preset, "envace", 0, "")
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    t0 = time.time()
    results = run_all(base, overrides, root, _SEEDS.value, sizes, tuple(_MODES.value))
    summary = summarize(results, sizes)
    verdicts = claims(summary, sizes)
    minutes = (time.time() - t0) / 60
    # The runs' own wall times, which stay true when finished runs are read back.
    run_minutes = sum(r["seconds"] for r in results) / 60
    md = results_markdown(summary, verdicts, budget, overrides, _SEEDS.value, run_minutes, sizes)
    with open(os.path.join(root, "results.md"), "w") as f:
        f.write(md)
    write_csv(os.path.join(root, "results.csv"), results)
    plot(os.path.join(root, "results.png"), summary, results, sizes)
    print("\n" + md)
    print(f"wrote {root}/results.md, results.csv, results.png ({minutes:.1f} min)")


if __name__ == "__main__":
    app.run(main)
