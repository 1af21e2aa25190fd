"""The `rehearsal_eval` job: test-time rehearsal of a trained workdir on held-out tasks.

    python -m envace_jax.main --config configs/demo.py:rehearsal_eval --workdir DIR
    python -m envace_jax.main --config configs/demo.py:rehearsal_eval --workdir OUT \\
        --config.rehearsal.checkpoint_dir=DIR          # read DIR's checkpoints, write to OUT

Policies, from the train job's workdir (`rehearsal.checkpoint_dir`, default `--workdir`):

* the EnvACE-trained policy: the newest readable checkpoint in `checkpoints/`;
* the warm-start policy: `warm_start/` (the train job saves it when
  `rehearsal.keep_warm_start`), else the checkpoint at global step `schedule.sft_steps`.

For each of `rehearsal.seeds` seeds, `rehearsal.tasks` tasks of split `rehearsal.split` (the
test split by default, whose worlds the train job never sees; seed s draws the tasks of
generation seed `config.seed + s`) are run:

* **no rehearsal**: one committed run per task (as the train job's evaluation);
* **parallel / sequential rehearsal** with N = max(`rehearsal.budgets`) attempts, by the
  EnvACE-trained policy and by the warm-start policy as the rehearser; the memory of every
  budget N' in `rehearsal.budgets` comes from the first N' attempts (see
  `testtime.rehearsal`), and conditions one committed run.

The committed run is always the EnvACE-trained policy's, greedy, in a fresh
real environment; the rehearser only writes the attempts, their assessments and (format
'summary') the memory, so the rows compare rehearsers as the paper's table does. A
warm-start-policy row without rehearsal is printed for reference.

Diagnostics (they read the task's reference solution, which no decision above does): `any
attempt ok` is the fraction of tasks where one of the N attempts made the reference calls (what
a perfect selector could put in the memory), `plan ok` the fraction whose selected plan is the
reference calls, `plan shown` the fraction whose memory carries it (`rehearsal.min_support`),
`follows` the fraction of committed runs whose calls equal the selected plan, `refusal recall`
and `response fidelity` what the attempts' calls meet when replayed in the real world
(`replayed`).

Outputs in the workdir: `rehearsal_eval.md` (the tables), `rehearsal_eval.json` (every number,
per seed), `rehearsal_vs_budget.png` (success versus N, mean and std over seeds).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from envace_jax import knobs
from envace_jax.configuration import JobConfig
from envace_jax.envs.base import error_code, parse_result_text
from envace_jax.envs.registry import domain
from envace_jax.runtime import checkpoint as ckpt_lib
from envace_jax.runtime.build import build_mesh, build_model, build_tokenizer
from envace_jax.runtime.metrics import table, verdict
from envace_jax.runtime.workdir import (
    ARCH_KEYS,
    checkpoint_target,
    config_differences,
    config_json,
    find_warm_start,
    run_dirs,
)
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.testtime import memory as mem
from envace_jax.testtime.demonstrations import exact_memory
from envace_jax.testtime.rehearsal import REHEARSAL_STRATEGIES, Committed, TestTimeRehearsal

REHEARSERS = ("EnvACE", "warm-start")
STRATA = ("visible", "hidden")  # demo tasks: is the branch's state in the prompt
MEMORY_ROWS = ("empty memory", "exact memory")  # memories that no rehearsal wrote


class RehearsalEvalError(ValueError):
    """The workdir to evaluate lacks a policy, or was trained with another architecture."""


# ------------------------------------------------------------------------------- loading


def train_dirs(config: JobConfig, workdir: str) -> tuple[str, str]:
    """(checkpoints directory, train workdir) of `rehearsal.checkpoint_dir` (or `workdir`),
    which may name the train workdir or its checkpoints/ directory."""
    root = os.path.abspath(config.rehearsal.checkpoint_dir or workdir)
    where = f"config.rehearsal.checkpoint_dir={config.rehearsal.checkpoint_dir!r}"
    if dirs := run_dirs(root):
        return dirs
    raise RehearsalEvalError(
        f"{where} (workdir {workdir!r}): no train job output at {root} (expected a checkpoints/ "
        "directory); run the train job there first or point the key at its workdir"
    )


def check_architecture(config: JobConfig, saved: dict, where: str) -> None:
    """Raises naming every architecture key whose value differs from the checkpoint's."""
    if differ := config_differences(config_json(config), saved, ARCH_KEYS):
        flags = " ".join(f"--config.{d}" for d in differ)
        raise RehearsalEvalError(
            f"{where} was trained with another architecture; pass {flags} (or the config "
            "variant it was trained with)"
        )


def load_policies(config, workdir, params, mesh) -> tuple[dict[str, Any], dict[str, Any]]:
    """({'EnvACE': params, 'warm-start': params}, info) from the train workdir: the newest
    readable checkpoint, and its run's warm start (`workdir.find_warm_start`)."""
    ckpt_dir, base = train_dirs(config, workdir)
    with ckpt_lib.Checkpointer(ckpt_dir, keep=1_000_000) as ckpt:
        if ckpt.latest_step() is None:
            raise RehearsalEvalError(f"{ckpt_dir}: no finished checkpoint to evaluate")
        try:
            step, state, meta = ckpt.restore(checkpoint_target(params, mesh))
        except (ckpt_lib.CheckpointError, ValueError) as e:
            raise RehearsalEvalError(
                f"{ckpt_dir}: no checkpoint restores as one policy's train state ({e}); "
                "rehearsal_eval evaluates single-policy runs (mode 'envace')"
            ) from e
    check_architecture(config, meta.get("config") or {}, f"checkpoint {ckpt_dir}/{step}")
    sft_steps = (meta.get("config") or {}).get("schedule", {}).get("sft_steps")
    try:
        warm = find_warm_start(base, sft_steps, params, mesh, f"no warm-start policy in {base}")
    except ValueError as e:
        raise RehearsalEvalError(str(e)) from e
    info = {
        "train_workdir": base,
        "trained_step": step,
        "trained_phase": meta.get("phase"),
        "warm_start_step": warm.step,
        "warm_start_from": warm.source,
        "train_final_eval": meta.get("final_eval"),
        "train_warm_start_eval": warm.meta.get("sft_eval"),
    }
    return {"EnvACE": state.params, "warm-start": warm.params}, info


# --------------------------------------------------------------------------- evaluation


def _same_calls(calls: Sequence[tuple[str, Any]], other: Sequence[tuple[str, Any]]) -> bool:
    sig = lambda cs: [(n, json.dumps(a, sort_keys=True)) for n, a in cs]  # noqa: E731
    return sig(calls) == sig(other)


def _memory_plan(rehearsal, budget: int):
    s = mem.select_plan(rehearsal.attempts[:budget], rehearsal.assessments[:budget])
    return None if s.index is None else rehearsal.attempts[s.index].calls


def _any_reference_plan(rehearsal, budget: int, task) -> bool:
    ref = mem.reference_plan(task)[0]
    return any(_same_calls(a.calls, ref) for a in rehearsal.attempts[:budget])


def _stratum(task) -> str | None:
    return (task.ground_truth or {}).get("stratum")


def _row_stats(committed: Committed, tasks, plans=None, any_ok=None) -> dict[str, float]:
    res = committed.results
    out = {
        "success": float(np.mean([r.success for r in res])),
        "reward": float(np.mean([r.reward for r in res])),
    }
    for stratum in STRATA:  # the domain's strata, where its tasks carry them
        picked = [r.success for r, t in zip(res, tasks, strict=True) if _stratum(t) == stratum]
        if picked:
            out[f"success {stratum}"] = float(np.mean(picked))
    if plans is not None:
        refs = [mem.reference_plan(t)[0] for t in tasks]
        out["any_ok"] = float(np.mean(any_ok))
        out["plan_ok"] = float(
            np.mean(
                [p is not None and _same_calls(p, ref) for p, ref in zip(plans, refs, strict=True)]
            )
        )
        out["follows"] = float(
            np.mean(
                [
                    p is not None and _same_calls(r.episode.calls, p)
                    for r, p in zip(res, plans, strict=True)
                ]
            )
        )
    return out


def evaluate_seed(
    ttr: TestTimeRehearsal, policies, tasks, budgets, key, eval_cfg, make_env, gate_only=False
) -> dict:
    """Every row of the table for one task set (run in environments from `make_env`):
    {row name: {budget: stats}}. gate_only: the rows without rehearsal only (none, the empty
    memory, the exact memory)."""
    n = max(budgets)
    executor = policies["EnvACE"]
    commit = lambda params, tasks_, memories, k: ttr.commit(  # noqa: E731
        params,
        tasks_,
        memories,
        make_env,
        key=k,
        sampling=SamplingParams(greedy=True),
        max_new_tokens=eval_cfg.max_new_tokens,
    )
    out: dict[str, dict] = {}
    ckey = jax.random.fold_in(key, 0)  # committed runs share a key: rows differ by memory only
    out["none"] = {0: _row_stats(commit(executor, tasks, None, ckey), tasks)}
    out["none, warm-start policy"] = {
        0: _row_stats(commit(policies["warm-start"], tasks, None, ckey), tasks)
    }
    empty = mem.render_memory([], [])
    oracle = [exact_memory(t, make_env, n) for t in tasks]
    for row, memories in zip(MEMORY_ROWS, ([empty] * len(tasks), oracle), strict=True):
        out[row] = {0: _row_stats(commit(executor, tasks, memories, ckey), tasks)}
    for name in REHEARSERS if not gate_only else ():
        by_executor = lambda rows, memories: commit(executor, rows, memories, ckey)  # noqa: E731
        out.update(
            _rehearser_rows(ttr, name, policies[name], tasks, budgets, key, make_env, by_executor)
        )
    return out


def replayed(rehearsals, tasks, budget: int, make_env) -> tuple[float, float]:
    """Diagnostics of the first `budget` attempts, replayed in fresh real environments: the
    share of real refusals rehearsed as errors (NaN: none), and of responses rehearsed right."""
    real = predicted = compared = equal = 0
    for r, task in zip(rehearsals, tasks, strict=True):
        for a in r.attempts[:budget]:
            env = make_env()
            env.reset(task)
            for (name, args), rehearsed in zip(a.calls, a.responses, strict=True):
                if rehearsed is None:
                    break
                got = env.step([{"name": name, "arguments": args}])[0]
                expected = parse_result_text(rehearsed)
                compared += 1
                equal += expected == got
                if error_code(got) is not None:
                    real += 1
                    predicted += error_code(expected) is not None
    recall = predicted / real if real else float("nan")
    return recall, (equal / compared if compared else float("nan"))


def _rehearser_rows(ttr, name, params, tasks, budgets, key, make_env, commit) -> dict:
    """The rows of one rehearser: each mode at each budget, its memories conditioning one
    committed run per task (`commit(tasks, memories)`: the EnvACE-trained policy's)."""
    n = max(budgets)
    rows, memories, plans, any_ok, recall, where = [], [], [], [], [], []
    for m_i, mode in enumerate(REHEARSAL_STRATEGIES):
        t0 = time.time()
        rkey = jax.random.fold_in(key, 10 + m_i)  # the same for both rehearsers (paired)
        rehearsals = ttr.rehearse(params, tasks, mode=mode, n=n, key=rkey)
        for b in budgets:
            memories += ttr.memories(
                params, tasks, rehearsals, budget=b, key=jax.random.fold_in(rkey, b)
            )
            plans += [_memory_plan(r, b) for r in rehearsals]
            any_ok += [_any_reference_plan(r, b, t) for r, t in zip(rehearsals, tasks, strict=True)]
            recall.append(replayed(rehearsals, tasks, b, make_env))
            rows += list(tasks)
            where.append((mode, b))
        print(f"  [{name} rehearser, {mode}] {n} attempts in {time.time() - t0:.0f}s", flush=True)
    t0 = time.time()
    committed = commit(rows, memories)
    print(f"  [{name} rehearser] committed runs in {time.time() - t0:.0f}s", flush=True)
    out: dict = {}
    T = len(tasks)
    for j, (mode, b) in enumerate(where):
        cut = slice(j * T, (j + 1) * T)
        part = Committed(committed.results[cut], committed.prompts[cut])
        stats = _row_stats(part, tasks, plans[cut], any_ok[cut])
        stats["refusal_recall"], stats["response_fidelity"] = recall[j]
        shown = memories[j * T : (j + 1) * T]
        # a memory without a plan may still carry avoid lines after its `plan: none`
        stats["plan_shown"] = float(np.mean([mem.NO_PLAN not in m.split("\n") for m in shown]))
        out.setdefault(f"{mode}, {name} rehearser", {})[b] = stats
    return out


def _aggregate(per_seed: list[dict]) -> dict:
    """{row: {budget: {metric: (mean, std, [per seed])}}}."""
    out: dict = {}
    for row in per_seed[0]:
        for b in per_seed[0][row]:
            # a seed whose tasks lack a stratum has no value for it: NaN, left out of the mean
            metrics = dict.fromkeys(k for s in per_seed for k in s[row][b])
            for metric in metrics:
                vals = [s[row][b].get(metric, float("nan")) for s in per_seed]
                kept = [v for v in vals if not np.isnan(v)]
                mean, std = (np.mean(kept), np.std(kept)) if kept else (np.nan, np.nan)
                out.setdefault(row, {}).setdefault(b, {})[metric] = (float(mean), float(std), vals)
    return out


def _cell(v) -> str:
    mean, std, _ = v
    return f"{mean:.3f} ± {std:.3f}"


def paired(row: dict, base: dict, metric: str = "success") -> tuple[float, float]:
    """Mean and standard error over seeds of `row` minus `base` (the same tasks and keys)."""
    diff = np.asarray(row[metric][2]) - np.asarray(base[metric][2])
    se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("nan")
    return float(diff.mean()), se


def table_rows(agg: dict, table_budget: int) -> list[tuple[str, int]]:
    """(row, budget) of the main table, in order, for the rows `agg` holds."""
    order = ["none", *MEMORY_ROWS]
    order += [f"{m}, {r} rehearser" for r in REHEARSERS for m in REHEARSAL_STRATEGIES]
    order.append("none, warm-start policy")
    return [(r, table_budget if "rehearser" in r else 0) for r in order if r in agg]


def tables(agg: dict, budgets: Sequence[int], table_budget: int, n_seeds: int, n_tasks: int) -> str:
    header = ["test-time rehearsal", "N", "success", "per seed", "minus none (± s.e.)"]
    header += [f"success {s}" for s in STRATA]
    header += ["any attempt ok", "plan ok", "plan shown", "follows", "refusal recall"]
    header += ["response fidelity"]
    rows = []
    for row, b in table_rows(agg, table_budget):
        m = agg[row][b]
        diff = "-" if row == "none" else "{:+.3f} ± {:.3f}".format(*paired(m, agg["none"][0]))
        cells = [row, b, _cell(m["success"]), " ".join(f"{x:.3f}" for x in m["success"][2]), diff]
        cells += [_cell(m[k]) if k in m else "-" for k in (f"success {s}" for s in STRATA)]
        diagnostics = ("any_ok", "plan_ok", "plan_shown", "follows", "refusal_recall")
        diagnostics += ("response_fidelity",)
        cells += [_cell(m[k]) if k in m else "-" for k in diagnostics]
        rows.append(cells)
    text = table(rows, header)
    curve = [r for r, _ in table_rows(agg, table_budget) if "rehearser" in r]
    if curve:
        curve_rows = [[r] + [_cell(agg[r][b]["success"]) for b in budgets] for r in curve]
        text += "\n\n" + table(curve_rows, ["success by N"] + [str(b) for b in budgets])
    if claims := claim_rows(agg, table_budget):
        text += "\n\n" + table(claims, ["claim", "bar", "all tasks", *STRATA])
    note = (
        f"mean ± std over {n_seeds} seeds of {n_tasks} held-out tasks each, differences paired by "
        "seed (± their standard error; a verdict needs twice it); the committed run is always the "
        "EnvACE-trained policy's; the hidden stratum is a negative control: rehearsal cannot know "
        "its state"
    )
    return f"{text}\n\n({note})"


CLAIMS = (  # (claim, row, baseline row, bar): differences of committed success
    ("exact memory - none", "exact memory", "none", "+0.05"),
    ("empty memory - none", "empty memory", "none", "-0.02"),
    ("parallel, EnvACE rehearser - none", "parallel, EnvACE rehearser", "none", ""),
    (
        "parallel, EnvACE - warm-start rehearser",
        "parallel, EnvACE rehearser",
        "parallel, warm-start rehearser",
        "",
    ),
    ("sequential, EnvACE rehearser - none", "sequential, EnvACE rehearser", "none", ""),
    (
        "sequential, EnvACE - warm-start rehearser",
        "sequential, EnvACE rehearser",
        "sequential, warm-start rehearser",
        "",
    ),
)


def claim_rows(agg: dict, table_budget: int) -> list[list[str]]:
    """Each claim whose rows ran: its paired difference, standard error and verdict, overall
    and per stratum (rehearser rows at `table_budget`)."""
    out = []
    for claim, row, base, bar in CLAIMS:
        if row not in agg or base not in agg:
            continue
        a = agg[row][table_budget if "rehearser" in row else 0]
        b = agg[base][table_budget if "rehearser" in base else 0]
        cells = []
        for metric in ["success"] + [f"success {s}" for s in STRATA]:
            if metric not in a or metric not in b:
                cells.append("-")
                continue
            d, se = paired(a, b, metric)
            cells.append(f"{d:+.3f} ± {se:.3f}, {verdict(d, se)}")
        out.append([claim, bar or "-", *cells])
    return out


def plot(agg: dict, budgets: Sequence[int], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for name in REHEARSERS:
        for mode, style in zip(REHEARSAL_STRATEGIES, ("-", "--"), strict=True):
            row = agg.get(f"{mode}, {name} rehearser")
            if row is None:
                continue
            means = [row[b]["success"][0] for b in budgets]
            stds = [row[b]["success"][1] for b in budgets]
            ax.errorbar(
                budgets,
                means,
                yerr=stds,
                linestyle=style,
                marker="o",
                capsize=3,
                label=f"{mode}, {name} rehearser",
            )
    for row, style in (("none", "k:"), ("none, warm-start policy", "C7:")):
        ax.axhline(
            agg[row][0]["success"][0],
            color=style[:-1],
            linestyle=":",
            label=row.replace("none", "no rehearsal"),
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(budgets), [str(b) for b in budgets])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("rehearsal budget N")
    ax.set_ylabel("real-environment success")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def workdir_policies(config: JobConfig, workdir: str):
    """(mesh, tokenizer, model, policies, info) of a job that evaluates a trained workdir's
    policies (`load_policies`) with the config's architecture."""
    mesh = build_mesh(config)
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer, mesh)
    policies, info = load_policies(config, workdir, nnx.state(model, nnx.Param), mesh)
    return mesh, tokenizer, model, policies, info


def run(config: JobConfig, workdir: str) -> dict:
    r = config.rehearsal
    t_start = time.time()
    mesh, tokenizer, model, policies, info = workdir_policies(config, workdir)
    print(
        f"EnvACE policy: checkpoint step {info['trained_step']} ({info['trained_phase']}); "
        f"warm-start policy: step {info['warm_start_step']} from {info['warm_start_from']}"
    )
    ttr = TestTimeRehearsal(
        model,
        tokenizer,
        max_turns=config.rollout.max_turns,
        max_message_tokens=config.rollout.max_message_tokens,
        memory=r.memory,
        assessor=r.assessor,
        sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p),
        max_new_tokens=config.eval.max_new_tokens,
        max_memory_tokens=r.max_memory_tokens,
        commit_rows=r.commit_rows,
        min_support=r.min_support,
    )
    budgets = tuple(sorted(set(r.budgets)))
    env_domain = domain(config.data.env, config.data)
    per_seed = []
    for s in range(r.seeds):
        t0 = time.time()
        tasks = env_domain.generate_tasks(config.seed + s, r.tasks, r.split)
        key = jax.random.fold_in(jax.random.key(config.seed), 1000 + s)
        print(f"[rehearsal eval] seed {s + 1}/{r.seeds}: {len(tasks)} {r.split} tasks", flush=True)
        per_seed.append(
            evaluate_seed(
                ttr, policies, tasks, budgets, key, config.eval, env_domain.make_env, r.gate_only
            )
        )
        done = time.time() - t_start
        eta = done / (s + 1) * (r.seeds - s - 1)
        shown = ", ".join(
            f"{row} {per_seed[-1][row][b]['success']:.3f}"
            for row, b in table_rows(per_seed[-1], r.table_budget)
        )
        print(
            f"[rehearsal eval] seed {s + 1}/{r.seeds} in {time.time() - t0:.0f}s, eta {eta:.0f}s: "
            f"success {shown}",
            flush=True,
        )
    agg = _aggregate(per_seed)
    text = tables(agg, budgets, r.table_budget, r.seeds, r.tasks)
    png = os.path.join(workdir, "rehearsal_vs_budget.png")
    plot(agg, budgets, png)
    with open(os.path.join(workdir, "rehearsal_eval.md"), "w") as f:
        f.write(text + "\n")
    config_out = json.loads(json.dumps(knobs.as_dict(r)))
    result = {"info": info, "config": config_out, "per_seed": per_seed}
    result["aggregate"] = agg
    with open(os.path.join(workdir, "rehearsal_eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nTest-time rehearsal on held-out {r.split} tasks:\n{text}")
    print(f"\nworkdir: {workdir} (rehearsal_eval.md, rehearsal_eval.json, rehearsal_vs_budget.png)")
    print(f"total time {time.time() - t_start:.0f}s")
    return result
