"""Held-out evaluation: in the real environment (the reference's protocol), or, for tasks that
have none, the judge's checklist score of rehearsed episodes (`checklist_evaluate`); headroom.

Every policy is scored the same way, whatever trained it:

* **greedy**: one committed execution per task, decoded greedily;
* **avg@4**: the mean success of `AVG_SAMPLES` sampled executions per task (the reference's
  validation setting, T=0.6, top_p=0.95: `config.eval.temperature` / `eval.top_p`), each run
  keyed by ``fold_in(key, s)``, so it is the mean of four seeded sampled evaluations;
* the standard error of each over the n tasks, ``sqrt(mean((s_i - mean)^2) / n)`` of the
  per-task successes s_i: for greedy, whose s_i are 0 or 1, the binomial ``sqrt(p (1 - p) / n)``;
* rehearsal fidelity of whoever rehearses.

`headroom` answers whether RL *can* move success before any RL runs: per task family, greedy
success, sampled pass@1 (mean success of k samples) and pass@k (any of k succeeds), at the
sampling setting of the RL rollouts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from envace_jax import parallel
from envace_jax.rollout.real_env import (
    RealEpisode,
    prefill_tasks,
    real_env_metrics,
    real_env_rollouts,
    rehearsal_fidelity,
)
from envace_jax.rollout.world_rehearsal import GroupSampling
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.text.codes import Status

AVG_SAMPLES = 4  # Sampled executions per task of the avg@4 score.


def _pooled(per_task: np.ndarray, everywhere: bool) -> tuple[float, float]:
    """Mean and standard error of per-task scores, over every process's tasks when
    `everywhere` (a collective)."""
    sums = np.asarray([per_task.size, per_task.sum(), (per_task**2).sum()], np.float64)
    if everywhere:
        sums = parallel.process_sum(sums)
    n, s, ss = sums
    if n == 0:
        return 0.0, 0.0
    mean = s / n
    var = max(ss / n - mean**2, 0.0)  # of the per-task scores; binomial p (1 - p) for 0/1
    return float(mean), float(math.sqrt(var / n))


def families_of(tasks: Sequence[Any], key: str = "family") -> list[str]:
    """The task families (`task.metadata[key]`: 'family', or 'stratum' for the hidden and
    visible strata) present in `tasks`, sorted."""
    return sorted({f for t in tasks if (f := t.metadata.get(key))})


def by_family(
    per_task: Sequence[float],
    mine: Sequence[Any],
    families: Sequence[str],
    everywhere: bool,
    key: str = "family",
) -> dict[str, float]:
    """Mean per-task score per task family (`task.metadata[key]`), over this process's tasks
    `mine` (every process's when `everywhere`, a collective: `families` must then be the same
    list on all). A family with no task here has no entry rather than a 0 that reads as
    "always fails": a rate over all tasks hides a skill that fails every time, so families
    are reported apart."""
    index = {f: i for i, f in enumerate(families)}
    sums = np.zeros((2, len(families)))
    for v, task in zip(per_task, mine, strict=True):
        i = index.get(task.metadata.get(key))
        if i is not None:
            sums[:, i] += (1, v)
    if everywhere:
        sums = parallel.process_sum(sums)
    return {f: float(sums[1, i] / sums[0, i]) for f, i in index.items() if sums[0, i]}


@dataclasses.dataclass
class EvalResult:
    """One held-out evaluation. `success`, `reward`, `tool_error_rate` and `invalid_rate` are
    the greedy run's; `success_avg4` the avg@4 score; `*_se` standard errors over tasks."""

    success: float
    success_se: float
    success_avg4: float
    success_avg4_se: float
    reward: float
    tool_error_rate: float
    invalid_rate: float
    fidelity: float
    # Success per task family (tasks whose metadata name one), written as `success/<family>`
    # (greedy) and `success_avg4/<family>`.
    by_family: dict[str, float] = dataclasses.field(default_factory=dict)
    by_family_avg4: dict[str, float] = dataclasses.field(default_factory=dict)
    # Success per stratum (tasks whose metadata name one: 'hidden', 'visible'), written as
    # `stratum_success/<stratum>` (greedy) and `stratum_success_avg4/<stratum>`.
    by_stratum: dict[str, float] = dataclasses.field(default_factory=dict)
    by_stratum_avg4: dict[str, float] = dataclasses.field(default_factory=dict)

    def headline(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in _HEADLINE}

    def line(self) -> str:
        """The headline as one readable console line."""
        avg4 = (
            ""
            if math.isnan(self.success_avg4)
            else (f", avg@4 {self.success_avg4:.3f} ± {self.success_avg4_se:.3f}")
        )
        return (
            f"success greedy {self.success:.3f} ± {self.success_se:.3f}{avg4}, reward "
            f"{self.reward:.3f}, tool errors {self.tool_error_rate:.3f}, invalid "
            f"{self.invalid_rate:.3f}, fidelity {self.fidelity:.3f}"
        )

    def as_dict(self) -> dict[str, float]:
        """Flat scalars (metrics.jsonl, TensorBoard, checkpoint metadata); a greedy-only
        evaluation leaves its avg@4 scores out."""
        out = {k: v for k, v in self.headline().items() if not math.isnan(v)}
        out.update({f"success/{f}": v for f, v in self.by_family.items()})
        out.update({f"success_avg4/{f}": v for f, v in self.by_family_avg4.items() if v == v})
        out.update({f"stratum_success/{f}": v for f, v in self.by_stratum.items()})
        out.update(
            {f"stratum_success_avg4/{f}": v for f, v in self.by_stratum_avg4.items() if v == v}
        )
        return out

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> EvalResult:
        fams = lambda prefix: {
            k.split("/", 1)[1]: v for k, v in d.items() if k.startswith(prefix + "/")
        }
        return cls(
            **{k: d.get(k, 0.0) for k in _HEADLINE},
            by_family=fams("success"),
            by_family_avg4=fams("success_avg4"),
            by_stratum=fams("stratum_success"),
            by_stratum_avg4=fams("stratum_success_avg4"),
        )


_HEADLINE = tuple(f.name for f in dataclasses.fields(EvalResult) if not f.name.startswith("by_"))


def my_tasks(mesh, tasks: Sequence[Any]) -> list[Any]:
    """The tasks whose rows this process runs (all of them on one host)."""
    return [tasks[i] for i in parallel.row_layout(mesh, len(tasks)).rows]


@dataclasses.dataclass(frozen=True)
class Executions:
    """Committed executions of `tasks` by the policy `sampler` holds, each in a fresh
    `make_env()` environment with a budget of `max_new_tokens`; a process runs its rows of
    `mesh` (every process calls together)."""

    sampler: Any
    tokenizer: Any
    tasks: Sequence[Any]
    make_env: Callable[[], Any]
    mesh: Any
    max_new_tokens: int

    def committed(
        self, key: jax.Array, sampling: SamplingParams, prefilled=None
    ) -> list[RealEpisode]:
        """One execution of each task (this process's rows of them); `prefilled`: `prefill`'s
        state, decoded instead of a new prefill."""
        layout = parallel.row_layout(self.mesh, len(self.tasks))
        return real_env_rollouts(
            self.sampler,
            self.tokenizer,
            [self.tasks[i] for i in layout.rows],
            self.make_env,
            key=key,
            sampling=sampling,
            max_new_tokens=self.max_new_tokens,
            layout=layout,
            prefilled=prefilled,
        )[0]

    def prefill(self):
        """The sampler state with this process's tasks prefilled, which every execution of
        them shares (a prefill is a fifth of a 256-task run)."""
        layout = parallel.row_layout(self.mesh, len(self.tasks))
        mine = my_tasks(self.mesh, self.tasks)
        return prefill_tasks(self.sampler, self.tokenizer, mine, self.max_new_tokens, None, layout)

    def greedy_and_sampled(
        self, key: jax.Array, sampling: SamplingParams, samples: int
    ) -> tuple[list[RealEpisode], list[list[RealEpisode]]]:
        """One greedy execution of each task (keyed by `key`), and `samples` sampled ones
        (keyed by ``fold_in(key, 1 + s)``), from one prefill: the runs every score here is
        made of."""
        state = self.prefill()
        greedy = self.committed(key, SamplingParams(greedy=True), state)
        sampled = [
            self.committed(jax.random.fold_in(key, 1 + s), sampling, state) for s in range(samples)
        ]
        return greedy, sampled


def committed_runs(
    sampler, tokenizer, tasks, make_env, mesh, *, key, sampling, max_new_tokens
) -> list[RealEpisode]:
    """One committed execution of each of `tasks` (this process's rows of them on a multi-host
    mesh; every process calls this together)."""
    runs = Executions(sampler, tokenizer, tasks, make_env, mesh, max_new_tokens)
    return runs.committed(key, sampling)


def evaluate(
    host_sampler,
    rehearse: Callable[..., Any],
    tokenizer,
    tasks: Sequence[Any],
    make_env: Callable[[], Any],
    mesh,
    eval_cfg,
    length_buckets: Sequence[int],
    key: jax.Array,
    greedy_only: bool = False,
) -> EvalResult:
    """The protocol of the module docstring. `host_sampler` holds the ACT params to evaluate;
    `rehearse(tasks, group, layout=)` gives world-rehearsal episodes by whoever rehearses (a
    `RolloutBatch`), for fidelity. `greedy_only`: a point of a learning curve, a fifth of the
    cost; its avg@4 scores are NaN."""
    mine = my_tasks(mesh, tasks)
    strata = families_of(tasks, "stratum")
    sampled = SamplingParams(temperature=eval_cfg.temperature, top_p=eval_cfg.top_p)
    runs = Executions(host_sampler, tokenizer, tasks, make_env, mesh, eval_cfg.max_new_tokens)
    samples = 0 if greedy_only else AVG_SAMPLES
    greedy, per_sample = runs.greedy_and_sampled(key, sampled, samples)
    greedy_ok = np.asarray([r.success for r in greedy], np.float64)
    avg_ok = np.full(len(mine), np.nan)
    if per_sample:
        avg_ok = np.mean([[r.success for r in rs] for rs in per_sample], axis=0)
    m = real_env_metrics(greedy, everywhere=True)
    success, success_se = _pooled(greedy_ok, everywhere=True)
    avg4, avg4_se = _pooled(avg_ok, everywhere=True)
    fidelity = 0.0
    if eval_cfg.fidelity_tasks:
        fid_tasks = tasks[: eval_cfg.fidelity_tasks]
        group = GroupSampling(
            group_size=1,
            key=jax.random.fold_in(key, 2**20),
            sampling=SamplingParams(greedy=True),
            max_new_tokens=eval_cfg.max_new_tokens,
            length_buckets=length_buckets,
        )
        layout = parallel.row_layout(mesh, len(fid_tasks))
        rb = rehearse(fid_tasks, group, layout=layout)
        share, compared = rehearsal_fidelity(rb.episodes, rb.tasks, make_env)
        matched, compared = parallel.process_sum([share * compared, compared])
        fidelity = float(matched / compared) if compared else 0.0
    return EvalResult(
        success=success,
        success_se=success_se,
        success_avg4=avg4,
        success_avg4_se=avg4_se,
        reward=m["reward"],
        tool_error_rate=m["tool_error_rate"],
        invalid_rate=m["invalid_rate"],
        fidelity=fidelity,
        by_family=by_family(greedy_ok, mine, families_of(tasks), everywhere=True),
        by_family_avg4=by_family(avg_ok, mine, families_of(tasks), everywhere=True),
        by_stratum=by_family(greedy_ok, mine, strata, True, "stratum"),
        by_stratum_avg4=by_family(avg_ok, mine, strata, True, "stratum"),
    )


def headroom(
    host_sampler,
    tokenizer,
    tasks: Sequence[Any],
    make_env: Callable[[], Any],
    mesh,
    *,
    key: jax.Array,
    sampling: SamplingParams,
    samples: int,
    max_new_tokens: int,
) -> dict[str, dict[str, float]]:
    """{family, 'stratum <name>' or 'all': {'tasks', 'greedy', 'pass@1', 'pass@k'}}: greedy
    success, and the mean and the any-of success of `samples` sampled executions per task,
    per task family, per stratum and over all tasks."""
    mine = my_tasks(mesh, tasks)
    runs = Executions(host_sampler, tokenizer, tasks, make_env, mesh, max_new_tokens)
    greedy_runs, sampled_runs = runs.greedy_and_sampled(key, sampling, samples)
    greedy = np.asarray([r.success for r in greedy_runs], np.float64)
    ok = np.asarray([[r.success for r in rs] for rs in sampled_runs], np.float64)
    scores = {"greedy": greedy, "pass@1": ok.mean(axis=0), "pass@k": ok.max(axis=0)}
    out = {}
    for key_, label in (("family", "{}"), ("stratum", "stratum {}")):
        groups = families_of(tasks, key_)
        per_group = {n: by_family(v, mine, groups, True, key_) for n, v in scores.items()}
        for g in groups:
            count = sum(t.metadata.get(key_) == g for t in tasks)
            out[label.format(g)] = {"tasks": count} | {n: per_group[n][g] for n in scores}
    out["all"] = {"tasks": len(tasks)} | {n: _pooled(v, True)[0] for n, v in scores.items()}
    return out


# ------------------------------------------------------------------------------------------
# Without an executable environment: the judge's checklist score of rehearsed episodes.

EVAL_ROWS = 64  # rehearsed episodes decoded per call (a call's rows x buffer bounds its memory)


@dataclasses.dataclass
class ChecklistEval:
    """Held-out evaluation of tasks that have no environment (the reference's validation): `k`
    sampled world-rehearsal episodes per task, each scored by the judge's checklist. avg@k is
    the mean score, pass@k the mean over tasks of the best of the k scores; `won_*` the same of
    the reference's pass metric, "some turn scored" (score > 0); `*_se` are standard errors over
    tasks; `by_source` per data source (`task.metadata['data_source']`)."""

    k: int
    checklist_avg: float
    checklist_avg_se: float
    checklist_pass: float
    checklist_pass_se: float
    won_avg: float
    won_pass: float
    invalid_rate: float
    judge_error_share: float
    by_source: dict[str, float] = dataclasses.field(default_factory=dict)
    by_source_pass: dict[str, float] = dataclasses.field(default_factory=dict)

    def headline(self) -> dict[str, float]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.name.startswith("by_")
        }

    def line(self) -> str:
        """The headline as one readable console line."""
        k = self.k
        return (
            f"checklist avg@{k} {self.checklist_avg:.3f} ± {self.checklist_avg_se:.3f}, pass@{k} "
            f"{self.checklist_pass:.3f} ± {self.checklist_pass_se:.3f}, won avg@{k} "
            f"{self.won_avg:.3f}, invalid {self.invalid_rate:.3f}, judge errors "
            f"{self.judge_error_share:.3f}"
        )

    def as_dict(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.headline().items()}
        out.update({f"checklist_avg/{s}": v for s, v in self.by_source.items()})
        out.update({f"checklist_pass/{s}": v for s, v in self.by_source_pass.items()})
        return out

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> ChecklistEval:
        per = lambda p: {k.split("/", 1)[1]: v for k, v in d.items() if k.startswith(p + "/")}
        names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("by_")]
        fields = {k: d.get(k, 0.0) for k in names}
        fields["k"] = int(fields["k"])
        return cls(**fields, by_source=per("checklist_avg"), by_source_pass=per("checklist_pass"))


def eval_from_dict(d: dict[str, float]) -> EvalResult | ChecklistEval:
    """An evaluation read back from metrics or checkpoint metadata, of either kind."""
    return ChecklistEval.from_dict(d) if "checklist_avg" in d else EvalResult.from_dict(d)


def checklist_evaluate(
    rehearse: Callable[..., Any],
    tasks: Sequence[Any],
    eval_cfg,
    length_buckets: Sequence[int],
    key: jax.Array,
) -> ChecklistEval:
    """`eval_cfg.val_n` world-rehearsal episodes of each task by `rehearse(tasks, group,
    layout=)` (the mode's players and its judge), sampled at `eval_cfg.temperature` / `top_p`,
    in calls of about EVAL_ROWS episodes. No environment is called. Every process runs every
    task (the held-out set is small)."""
    k = eval_cfg.val_n
    per_call = max(1, EVAL_ROWS // k)
    sampling = SamplingParams(temperature=eval_cfg.temperature, top_p=eval_cfg.top_p)
    scores, invalid, stats = [], [], {"judge_failures": 0.0, "asked": 0.0}
    for c, start in enumerate(range(0, len(tasks), per_call)):
        chunk = [tasks[i] for i in range(start, min(start + per_call, len(tasks)))]
        group = GroupSampling(
            group_size=k,
            key=jax.random.fold_in(key, c),
            sampling=sampling,
            max_new_tokens=eval_cfg.max_new_tokens,
            length_buckets=length_buckets,
        )
        rb = rehearse(chunk, group, layout=None)
        n = len(rb.episodes)
        scores.append(np.asarray(rb.batch.reward[:n], np.float64).reshape(len(chunk), k))
        invalid += [ep.status == Status.INVALID for ep in rb.episodes]
        stats["judge_failures"] += rb.stats.get("judge_failures", 0.0)
        asked = rb.stats.get("judge_items", 0.0) - rb.stats.get("judge_short_circuit", 0.0)
        stats["asked"] += asked
    table = np.concatenate(scores) if scores else np.zeros((0, k))
    avg, best = table.mean(axis=1), table.max(axis=1, initial=0.0)
    sources = families_of(tasks, "data_source")
    mine = list(tasks)
    score_avg, score_avg_se = _pooled(avg, everywhere=False)
    score_pass, score_pass_se = _pooled(best, everywhere=False)
    return ChecklistEval(
        k=k,
        checklist_avg=score_avg,
        checklist_avg_se=score_avg_se,
        checklist_pass=score_pass,
        checklist_pass_se=score_pass_se,
        won_avg=float(np.mean(table > 0)) if table.size else 0.0,
        won_pass=float(np.mean(np.any(table > 0, axis=1))) if table.size else 0.0,
        invalid_rate=float(np.mean(invalid)) if invalid else 0.0,
        judge_error_share=stats["judge_failures"] / stats["asked"] if stats["asked"] else 0.0,
        by_source=by_family(avg, mine, sources, False, "data_source"),
        by_source_pass=by_family(best, mine, sources, False, "data_source"),
    )
