"""Mini-replication of the paper's comparison on the demo domain.

    python -m envace_jax.experiments.compare --workdir DIR            # full (~59 min on 2 cores)
    python -m envace_jax.experiments.compare --workdir DIR --quick    # quick (~8 min)
    python -m envace_jax.experiments.compare --workdir DIR --set rollout.group_size=8  # any key
    python -m envace_jax.experiments.compare --workdir DIR --modes sft_only,grpo_real_env  # ~14 min

Every arm (`verdicts.ARMS`: a training mode, in each rehearsal view where it rehearses; or
those `--modes` names) x 3 seeds, with the same budget,
on the main policy size; with a second `--presets` entry, a model-scale study: the modes that
carry the scaling claim, on a smaller policy. Every run evaluates its final policy the same
way (greedy and avg@4 on 256 held-out tasks, `envace_jax.evaluation`; the warm start's
evaluation is the `sft_only` arm's), and claims are judged on avg@4. Writes
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
import importlib.util
import json
import os
import sys
import time
from typing import Any

import ml_collections
from absl import app, flags, logging

from envace_jax.configuration import validate
from envace_jax.experiments.verdicts import (
    ARMS,
    SCALE_MODES,
    SIZES,
    claims,
    plot,
    results_markdown,
    summarize,
    write_csv,
)
from envace_jax.metrics import read_metrics

SEEDS = (0, 1, 2)

# Per-run overrides, the same for every mode. `full` keeps the demo config's warm start, its RL
# steps, rollouts per step and learning-rate schedule, and evaluates on 256 held-out tasks;
# `quick` also shortens the warm start and RL (its numbers check the pipeline more than the
# claims).
BUDGETS: dict[str, dict[str, Any]] = {
    "full": {
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
# Bookkeeping the same in every run: evaluate the final policy only (the `sft_only` arm is
# the warm start's evaluation on each seed's tasks), checkpoint rarely.
_COMMON = {
    "schedule.eval_every": 0,
    "schedule.eval_warm_start": False,
    "schedule.checkpoint_every": 1000,
    "schedule.keep_checkpoints": 1,
    "schedule.log_every": 20,
}
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
_MODES = flags.DEFINE_list("modes", list(ARMS), "Arms (verdicts.ARMS) of the main comparison.")


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
    """The config of one run: `mode` is an arm (`verdicts.ARMS`)."""
    config = ml_collections.ConfigDict(base.to_dict())
    apply(config, overrides)
    if preset != config.model.preset:  # another size: random init (a shipped base is one size)
        config.model.hf_path = ""
    config.model.preset = preset
    config.mode, view = ARMS[mode]
    if view:
        config.rollout.rehearsal_view = view
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
    seeds: int, sizes: dict[str, str] = SIZES, modes: tuple[str, ...] = tuple(ARMS)
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
    base, overrides, root: str, seeds: int, sizes=SIZES, modes=tuple(ARMS)
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
        unknown = [m for m in _MODES.value if m not in ARMS]
        if unknown:
            raise ValueError(f"--modes: unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
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
