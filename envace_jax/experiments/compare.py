"""Mini-replication of the paper's comparison on the demo domain, with its control.

    python -m envace_jax.experiments.compare --workdir DIR            # full
    python -m envace_jax.experiments.compare --workdir DIR --quick    # quick
    python -m envace_jax.experiments.compare --workdir DIR --set rollout.group_size=8  # any key
    python -m envace_jax.experiments.compare --workdir DIR --modes sft_only,grpo_real_env --seeds 0

Every arm (`verdicts.ARMS`: the training modes, EnvACE in both rehearsal views, and the
corrupted worlds of the sensitivity control; or those `--modes` names) x seeds, with the same
budget. Every run evaluates its final policy the same way (greedy and avg@4 on held-out *test*
tasks, `envace_jax.train.evaluation`, overall and per stratum; the warm start's evaluation is the
`sft_only` arm's), and claims are judged on avg@4. Writes `results.md` (tables, the
sensitivity bars and the claim-by-claim verdicts), `results.csv` (one line per run) and
`results.png` (bars) into DIR; each run keeps its own workdir under DIR/runs/.

Protocol (the same for every arm, nothing tuned per arm; the recipe was chosen on validation
tasks, docs/recipe.md):
* base config: `configs/demo.py` (`--config`), then the budget (`BUDGETS`), then `--set`s;
* one warm start (arm 'sft_only', seed 0), shared by every arm and seed: each RL run loads it
  (`schedule.warm_start_dir`) and takes the same number of optimizer steps with the same
  rollouts per step;
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

from envace_jax.configuration import load, validate
from envace_jax.experiments.verdicts import (
    ARMS,
    claims,
    plot,
    results_markdown,
    sensitivity,
    summarize,
    write_csv,
)
from envace_jax.runtime.metrics import read_metrics

SEEDS = ("0", "1", "2")

# Per-run overrides, the same for every mode. `full` keeps the demo config's warm start, its RL
# steps, rollouts per step and learning-rate schedule, and evaluates on 256 held-out tasks;
# `quick` also shortens the warm start and RL (its numbers check the pipeline more than the
# claims).
BUDGETS: dict[str, dict[str, Any]] = {
    "full": {
        "data.eval_tasks": 64,
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
# Bookkeeping the same in every run: evaluate the final policy only, on test tasks (the
# `sft_only` arm is the warm start's evaluation on each seed's tasks), checkpoint rarely.
_COMMON = {
    "data.eval_split": "test",
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
_SEEDS = flags.DEFINE_list("seeds", list(SEEDS), "Seeds of every arm, e.g. 0,1,2.")
_MODES = flags.DEFINE_list("modes", list(ARMS), "Arms (verdicts.ARMS) of the comparison.")


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


def run_config(base, overrides: dict[str, Any], arm: str, seed: int, warm: str):
    """The config of one run of `arm` (`verdicts.ARMS`)."""
    config = ml_collections.ConfigDict(base.to_dict())
    apply(config, {**overrides, **ARMS[arm]})
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
    from envace_jax.train.trainer import Trainer

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1)
    trainer = Trainer(load(config), workdir)
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


def plan(seeds, modes: tuple[str, ...] = tuple(ARMS)) -> list[tuple[str, int]]:
    """(arm, seed) of every run, the warm start (sft_only, seed 0) first."""
    chosen = ("sft_only",) + tuple(m for m in modes if m != "sft_only")
    runs = [(mode, seed) for mode in chosen for seed in seeds]
    first = ("sft_only", 0)
    return [first] + [r for r in runs if r != first]


def run_all(base, overrides, root: str, seeds, modes=tuple(ARMS)) -> list[dict[str, Any]]:
    runs = plan(seeds, modes)
    results = []
    t0 = time.time()
    warm = os.path.join(root, "runs", "warm_start")
    for i, (mode, seed) in enumerate(runs):
        if mode == "sft_only" and seed == 0:
            workdir, warm_dir = warm, ""  # the warm start itself
        else:
            workdir, warm_dir = os.path.join(root, "runs", mode, f"seed{seed}"), warm
        config = run_config(base, overrides, mode, seed, warm_dir)
        print(f"[compare] run {i + 1}/{len(runs)}: arm={mode} seed={seed}", flush=True)
        r = run_one(config, workdir)
        if mode != "sft_only" or seed in seeds:
            results.append({"mode": mode, "seed": seed, **r})
        done = time.time() - t0
        print(
            f"[compare] {i + 1}/{len(runs)} done, {done / 60:.1f} min elapsed: "
            f"success={r['success']:.3f} avg@4={r['success_avg4']:.3f}",
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
    from envace_jax.runtime.workdir import use_compile_cache

    use_compile_cache(root)  # every run compiles the same programs

    budget = "quick" if _QUICK.value else "full"
    try:
        seeds = [int(x) for x in _SEEDS.value]
        if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
            raise ValueError(f"--seeds: expected distinct seeds >= 0, got {_SEEDS.value}")
        unknown = [m for m in _MODES.value if m not in ARMS]
        if unknown:
            raise ValueError(f"--modes: unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
        base = load_config(_CONFIG.value)
        overrides = {**BUDGETS[budget], **_COMMON, **parse_overrides(_SET.value)}
        for arm in _MODES.value:  # fail fast on a bad key or value
            run_config(base, overrides, arm, 0, "")
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    t0 = time.time()
    results = run_all(base, overrides, root, seeds, tuple(_MODES.value))
    summary = summarize(results)
    verdicts, bars = claims(summary), sensitivity(summary)
    minutes = (time.time() - t0) / 60
    # The runs' own wall times, which stay true when finished runs are read back.
    run_minutes = sum(r["seconds"] for r in results) / 60
    md = results_markdown(summary, verdicts, bars, budget, overrides, seeds, run_minutes)
    with open(os.path.join(root, "results.md"), "w") as f:
        f.write(md)
    write_csv(os.path.join(root, "results.csv"), results)
    plot(os.path.join(root, "results.png"), summary, results)
    print("\n" + md)
    print(f"wrote {root}/results.md, results.csv, results.png ({minutes:.1f} min)")


if __name__ == "__main__":
    app.run(main)
