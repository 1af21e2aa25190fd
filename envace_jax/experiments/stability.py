"""Does the RL recipe hold its gain? Learning curves of the demo's RL arms on test tasks.

    python -m envace_jax.experiments.stability --workdir DIR              # 12 RL steps
    python -m envace_jax.experiments.stability --workdir DIR --rl-steps 24 --eval-every 6

Real-environment GRPO and grounded EnvACE (`--modes`), seeds 0-2, from the comparison's one
shared warm start, each trained for `--rl-steps` steps and evaluated (greedy, on the test
tasks the comparison reports) every `--eval-every` steps. A run *holds* when its success at
its last step is within `TOLERANCE` of its best evaluated step, or above it. Writes
`stability.md` (each run's curve and verdict) and `stability.png` (the curves) into DIR; the
runs live in DIR/runs/ and are reused by a rerun, as in `compare`.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from absl import app, flags, logging

from envace_jax.experiments import compare
from envace_jax.runtime.metrics import read_metrics

TOLERANCE = 0.02  # a run holds when its last evaluation is at most this far below its best
SCORE = "success"  # greedy success: a curve point costs one execution per task

# --workdir, --config, --seeds, --modes and --set are compare's flags (one definition each);
# --modes defaults here to the two arms whose curves the study follows.
MODES = ("grpo_real_env", "envace_grounded")
_STEPS = flags.DEFINE_integer("rl_steps", 12, "RL steps of every run.")
_EVERY = flags.DEFINE_integer("eval_every", 4, "RL steps between test evaluations.")


def _evals(workdir: str) -> list[tuple[int, dict]]:
    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    return [(r["step"], r) for r in rows if r["phase"] == "eval"]


def curves(root: str, modes, seeds) -> dict[tuple[str, int], list[tuple[int, dict]]]:
    """(arm, seed) -> [(RL step, eval metrics)] from each run's metrics.jsonl, after the warm
    start's evaluation on that seed's tasks (step 0: the `sft_only` run of the seed)."""
    out = {}
    for seed in seeds:
        warm = os.path.join(
            root, "runs", *(("warm_start",) if seed == 0 else ("sft_only", f"seed{seed}"))
        )
        start = _evals(warm)[-1:]
        for mode in modes:
            rl = [p for p in _evals(os.path.join(root, "runs", mode, f"seed{seed}")) if p[0] > 0]
            out[(mode, seed)] = start + rl
    return out


def holds(curve: list[tuple[int, dict]], key: str = SCORE) -> tuple[float, float, bool]:
    """(last, best, held) over the evaluated RL steps (the warm start's point excluded)."""
    points = [m[key] for step, m in curve if step > 0]
    last, best = points[-1], max(points)
    return last, best, last >= best - TOLERANCE


def report(found, steps: int, every: int) -> str:
    lines = [
        "# Stability of the RL recipe",
        "",
        f"Each run: {steps} RL steps from the shared warm start, greedy success on the test "
        f"tasks every {every} steps. A run holds when its last point is within "
        f"{TOLERANCE * 100:.0f} points of its best, or above it.",
        "",
        "| arm | seed | success by RL step | hidden | visible | avg@4 at the last step "
        "| last - best | holds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    held, by_step = [], {}
    for (mode, seed), curve in found.items():
        if not any(step > 0 for step, _ in curve):
            continue
        last, best, ok = holds(curve)
        held.append(ok)
        for step, m in curve:
            by_step.setdefault(mode, {}).setdefault(step, []).append(m[SCORE])
        pts = ", ".join(f"{step}: {m[SCORE]:.3f}" for step, m in curve)
        strata = [
            ", ".join(f"{m.get(f'stratum_success/{s}', np.nan):.2f}" for _, m in curve)
            for s in ("hidden", "visible")
        ]
        avg4 = curve[-1][1].get("success_avg4", np.nan)
        lines.append(
            f"| {mode} | {seed} | {pts} | {strata[0]} | {strata[1]} | {avg4:.3f} | "
            f"{last - best:+.3f} | {'yes' if ok else 'no'} |"
        )
    lines += ["", f"{sum(held)} of {len(held)} runs hold. Mean over seeds by RL step:"]
    for mode, steps in by_step.items():
        means = ", ".join(f"{step}: {np.mean(v):.3f}" for step, v in sorted(steps.items()))
        lines.append(f"* {mode}: {means}")
    return "\n".join(lines) + "\n"


def plot(path: str, found, modes) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), sharey=True)
    for ax, mode in zip(np.atleast_1d(axes), modes, strict=True):
        for (m, seed), curve in found.items():
            if m == mode and curve:
                steps, values = zip(*[(s, r[SCORE]) for s, r in curve], strict=True)
                ax.plot(steps, values, "o-", label=f"seed {seed}")
        ax.set_title(f"{mode}: test success (greedy)")
        ax.set_xlabel("RL step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not compare._WORKDIR.value:
        raise app.UsageError("--workdir is required")
    modes = list(compare._MODES.value if flags.FLAGS["modes"].present else MODES)
    root = os.path.abspath(compare._WORKDIR.value)
    os.makedirs(root, exist_ok=True)
    logging.set_verbosity(logging.WARNING)
    from envace_jax.runtime.workdir import use_compile_cache

    use_compile_cache(root)  # every run compiles the same programs
    try:
        seeds = [int(s) for s in compare._SEEDS.value]
        base = compare.load_config(compare._CONFIG.value)
        overrides = {
            **compare.BUDGETS["full"],
            **compare._COMMON,
            "schedule.rl_steps": _STEPS.value,
            "schedule.eval_every": _EVERY.value,
            **compare.parse_overrides(compare._SET.value),
        }
        for arm in modes:
            compare.run_config(base, overrides, arm, 0, "")
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    t0 = time.time()
    compare.run_all(base, overrides, root, seeds, ("sft_only", *modes))
    found = curves(root, modes, seeds)
    text = report(found, _STEPS.value, _EVERY.value)
    with open(os.path.join(root, "stability.md"), "w") as f:
        f.write(text)
    plot(os.path.join(root, "stability.png"), found, modes)
    print("\n" + text)
    print(f"wrote {root}/stability.md, stability.png ({(time.time() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    app.run(main)
