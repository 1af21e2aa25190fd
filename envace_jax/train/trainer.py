"""The EnvACE training loop: warm-start SFT -> world-rehearsal RL -> real-environment evaluation.

    Trainer(configuration.load(config), workdir).run()   # or Trainer(job, workdir, Hooks(...))

The tasks, environment and oracle come from the domain `data.env` names (`envs.registry`);
what a mode decides (rollouts, state layout, who plays each role, exports) from its strategy
(`strategies`, from its row of `envace_jax.modes`); the run directory's layout and warm-start
lookup from `runtime.workdir`; the summary and curves from `report`. `Hooks` observe a run at
each checkpoint and at its end. Both phases run in one loop frame (`Phase`, `_loop`).

1. **Warm start.** Cross-entropy on oracle demonstrations of the training tasks, both roles: the
   agent's messages (ACT) and the real environment's responses (REHEARSE targets).
2. **RL.** Per step: `rollout.tasks_per_step` tasks x `rollout.group_size` trajectories, judged,
   then one role-wise GRPO update; `config.mode` picks the rollouts and the parameters. A warm
   start can also be loaded from another run's workdir (`schedule.warm_start_dir`).
3. **Evaluation** of committed execution in the real environment on held-out tasks (after the
   warm start, every `schedule.eval_every` RL steps, and at the end): success, reward, tool-error
   rate, and rehearsal fidelity (rehearsed responses equal to the real environment's). Tasks
   without an environment (`data.env = 'files'`, `eval.kind = 'checklist'`) are evaluated by
   the judge's checklist score of `eval.val_n` rehearsed episodes each (avg@k, pass@k).

The reward is `config.judge`'s (`rewards.judges`): the items' rules, or an LLM judge over HTTP,
which is asked for one verdict before anything else runs and stops the run with one line when
it fails (`JudgeFailed`).

Global step numbering: warm-start steps are 1..S, RL steps S+1..S+R, so one checkpoint sequence
covers both phases. Every random draw is keyed by (seed, global step), and data positions are a
function of the step, so a run resumed from a checkpoint ends with the same parameters as one
that never stopped.

Multi-host (one process per TPU host, `jax.distributed` initialised by `main`): one global mesh
for the steps and the samplers; each process builds, samples, judges and evaluates only the rows
of each global batch its devices hold (`parallel.RowLayout`), checkpoints go to
`schedule.checkpoint_dir` (shared, e.g. gs://) with every process writing its shards, and
metrics, plots and the summary come from process 0 (every process takes part in the export).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import jax
from flax import nnx

from envace_jax import modes, parallel
from envace_jax.configuration import JobConfig
from envace_jax.data.stream import TaskStream, length_grouped_batch
from envace_jax.envs.base import CallCounter
from envace_jax.envs.registry import domain
from envace_jax.rewards.judges import build_judge
from envace_jax.rl.optim import make_optimizer
from envace_jax.rl.steps import (
    TrainState,
    frozen_copy,
    init_train_state,
    make_grpo_step,
    make_sft_step,
    make_shardings,
    shard_batch,
)
from envace_jax.runtime import interrupts
from envace_jax.runtime.build import build_mesh, build_model, build_tokenizer
from envace_jax.runtime.metrics import MetricsWriter, Progress, truncate_metrics
from envace_jax.runtime.workdir import (
    RunDir,
    abstract_train_state,
    params_target,
    phase_at,
)
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.testtime.demonstrations import MemoryTasks
from envace_jax.train import evaluation, report, warm_start_data
from envace_jax.train.diagnostics import copy_metrics, held_out_probe
from envace_jax.train.evaluation import eval_from_dict
from envace_jax.train.phase import Hooks, Phase, check_finite, float_metrics, ignore
from envace_jax.train.strategies import RolloutSetup, strategy


class Trainer:
    def __init__(self, config: JobConfig, workdir: str, hooks: Hooks | None = None):
        if not isinstance(config, JobConfig):
            raise TypeError("Trainer takes a JobConfig: configuration.load(config_dict)")
        started = time.time()
        # Seconds by part of the run (summary.json): build, warm start, RL, each evaluation.
        self.times: dict[str, float] = {}
        self.config, self.workdir, self.hooks = config, workdir, hooks or Hooks()
        self.judge = build_judge(config.judge)
        self.judge.check()  # a judge that is down stops the job before any work
        self.mesh = build_mesh(config)
        self.tokenizer = build_tokenizer(config)
        self.model = build_model(config, self.tokenizer, self.mesh)
        self.graphdef, params, self.rest = nnx.split(self.model, nnx.Param, ...)
        self.pad_id = self.tokenizer.pad_token_id
        self.key = jax.random.key(config.seed)
        self.eval_key = jax.random.fold_in(self.key, 2**31 - 1)  # a stream apart from training
        self._final_eval_key = jax.random.fold_in(self.eval_key, 2**30)
        self._tasks(config)
        s, r = config.schedule, config.rollout
        self.sft_tx = make_optimizer(config.sft_optim)
        longest = max(r.length_buckets)
        self.sft_shardings = make_shardings(
            self.mesh, params, self.sft_tx, (s.sft_batch_size, longest)
        )
        self.sft_step = make_sft_step(
            self.model, self.sft_tx, config.sft, shardings=self.sft_shardings
        )
        # RL's environment calls are counted: world rehearsal makes none.
        self.rl_envs = CallCounter(self.domain.make_env)
        setup = RolloutSetup(
            self.model,
            self.tokenizer,
            self.rl_envs,
            r,
            self.rl_layout,
            self.domain.corrupted_envs,
            self.judge,
        )
        self.mode = strategy(modes.lookup(config.mode, r.rehearsal_view), setup)
        self.sft_steps = s.sft_steps
        self.rl_steps = s.rl_steps if self.mode.row.has_rl else 0
        self.rl_tx = self.rl_shardings = self.grpo_step = None
        if self.rl_steps:
            self._build_rl(params)
        self.run_dir = RunDir(config, workdir)
        self.writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
        self._demos = self._probe = None
        self.times["build"] = time.time() - started

    # ------------------------------------------------------------------------------- run

    def run(self, force: bool = False) -> dict[str, Any]:
        """Trains, or resumes from the newest readable checkpoint. A finished run (its final
        checkpoint restored) only writes its outputs again; `force` redoes its evaluation."""
        t_start = time.time()
        step, state, meta = self.restore()
        if meta.get("phase") == "done" and step == self.sft_steps + self.rl_steps and not force:
            print(f"the run is complete (step {step}); --force redoes its final evaluation")
            final = eval_from_dict(meta["final_eval"])
            return self._finish(state, meta["sft_eval"], final, 0.0)
        if state is None and self.config.schedule.warm_start_dir:
            step, state, meta = self.load_warm_start(self.config.schedule.warm_start_dir)
        if state is None:
            state = self.fresh_state(nnx.state(self.model, nnx.Param), "sft")
        if step < self.sft_steps:
            with self._timed("warm_start"):
                state = self._loop(self._sft_phase(), state, step)
            step = self.sft_steps
        if "sft_eval" not in meta:
            state, meta = self._end_warm_start(step, state, meta)
        last = self.sft_steps + self.rl_steps
        if self.rl_steps:
            with self._timed("rl"):
                state = self._run_rl(state, step, meta)
            with self._timed("eval_final"):
                final = self.evaluate(state.params, self.eval_tasks, self._final_eval_key)
            self.writer.write(self.rl_steps, "eval", final.as_dict(), global_step=last)
        else:  # the final policy is the warm start, evaluated once (metrics has its row)
            final = eval_from_dict(meta["sft_eval"])
        self._save(last, state, {**meta, "phase": "done", "final_eval": final.as_dict()})
        self.run_dir.checkpointer.wait()
        self._step_boundary()  # an interrupt Orbax swallowed in the last wait stops the export
        return self._finish(state, meta["sft_eval"], final, time.time() - t_start)

    def _loop(self, phase: Phase, state, start: int):
        """The frame both phases share: stop point, update, metrics row with a finite check,
        progress line, what follows the row, checkpoint."""
        s = self.config.schedule
        progress = Progress(phase.title, phase.steps, start)
        last_good = phase.offset + start
        for i in range(start + 1, phase.steps + 1):
            g = phase.offset + i
            self._step_boundary()
            state, metrics = phase.step(state, i)
            logged = phase.logs(i)
            if logged:
                m = float_metrics(metrics)
                check_finite(m, phase.what, g, last_good)
                shown = phase.shown(state, i, m)
                self.writer.write(i, phase.name, m, global_step=g)
                progress.update(i, **shown)
            phase.after(state, i)
            if i % s.checkpoint_every == 0 and i < phase.steps:
                if not logged:
                    check_finite(float_metrics(metrics), phase.what, g, last_good)
                self._save(g, state, phase.meta(i))
                last_good = g
        return state

    # ---------------------------------------------------------------------- construction

    @contextlib.contextmanager
    def _timed(self, part: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.times[part] = self.times.get(part, 0.0) + time.time() - t0

    def _tasks(self, config: JobConfig) -> None:
        """The domain, its training and held-out tasks, and the rows of each global batch this
        process builds (every row on one host)."""
        r = config.rollout
        # Task files: each process reads its share of the training rows, and samples the groups
        # of its own rows. The grounded view builds the whole batch on every process, so there
        # every process reads every row.
        process = (jax.process_index(), jax.process_count())
        if r.rehearsal_view == "grounded":
            process = (0, 1)
        self.domain = domain(
            config.data.env, config.data, tokenizer=self.tokenizer, process=process
        )
        self.eval_kind = config.eval.kind
        if self.eval_kind == "auto":
            self.eval_kind = "environment" if self.domain.has_env else "checklist"
        self.train_tasks = self.domain.generate_tasks(config.seed, config.data.train_tasks, "train")
        # A share of RL prompts carries a memory (testtime.demonstrations).
        rm, make_env = config.rehearsal.rl_memory_fraction, self.domain.make_env
        self.rl_tasks = MemoryTasks(self.train_tasks, make_env, fraction=rm, seed=config.seed + 1)
        self.eval_tasks = self.domain.held_out_tasks(config)
        self.sft_layout = parallel.row_layout(self.mesh, config.schedule.sft_batch_size)
        self.rl_layout = parallel.row_layout(self.mesh, r.group_size * r.tasks_per_step)
        if process[1] > 1 and not self.domain.has_env:
            # Each host holds only its share of the training tasks, so every group must be
            # sampled on one host.
            parallel.check_whole_groups(self.rl_layout, r.group_size, "rollout.group_size")

    def _build_rl(self, params) -> None:
        """The RL phase's optimizer, shardings and GRPO step (only for a mode that trains RL)."""
        r = self.config.rollout
        self.rl_tx = make_optimizer(self.config.optim)
        rows = (r.group_size * r.tasks_per_step, max(r.length_buckets))
        self.rl_shardings = make_shardings(self.mesh, params, self.rl_tx, rows)
        self.grpo_step = self.mode.grpo_step(
            lambda c: make_grpo_step(self.model, self.rl_tx, c, shardings=self.rl_shardings),
            self.config.grpo,
        )

    # --------------------------------------------------------------------------- warm start

    def _sft_phase(self) -> Phase:
        s = self.config.schedule
        if self._demos is None:
            self._demos = self.sft_examples()
        lengths = [len(d.ids) for d in self._demos]

        def step(state, i):
            indices = length_grouped_batch(
                lengths, self.config.seed, i - 1, s.sft_batch_size, s.sft_length_window
            )
            return self.sft_step(state, self.sft_batch(indices))

        def shown(state, i, m):
            out = {"loss": m["loss"], "nll": m["nll"]}
            if s.probe_every and (i % s.probe_every == 0 or i == self.sft_steps):
                probe = self._copy_metrics(state.params)
                m.update(probe)
                # The bar shows the three headline scores; the per-tool ones go to the logs.
                out.update({k.split("/")[1]: v for k, v in probe.items() if k.count("/") == 1})
            return out

        return Phase(
            name="sft",
            what="warm-start",
            title="warm start",
            offset=0,
            steps=self.sft_steps,
            step=step,
            logs=lambda i: i % s.log_every == 0 or i == self.sft_steps,
            shown=shown,
            after=ignore,
            meta=lambda i: {"phase": "sft", "data_position": i * s.sft_batch_size},
        )

    def sft_examples(self) -> list:
        """The warm start's demonstrations, one per training task (`warm_start_data`)."""
        return warm_start_data.demonstrations(
            self.config, self.domain, self.train_tasks, self.tokenizer
        )

    def sft_batch(self, indices: list[int]):
        """The warm-start batch of demonstrations `indices`; this process builds its rows only."""
        if self._demos is None:
            self._demos = self.sft_examples()
        layout = self.sft_layout
        rows = [self._demos[indices[i] % len(self._demos)] for i in layout.rows]
        buckets = self.config.rollout.length_buckets
        batch = warm_start_data.bucketed_batch(rows, layout.rows, self.pad_id, buckets)
        return self._global_batch(batch, layout, self.sft_shardings)

    def _global_batch(self, batch, layout: parallel.RowLayout, shardings):
        """The step's global batch from host rows: this process's rows (`layout.rows`) of a
        multi-process run, or else a whole batch that every process built (of any row count: a
        grounded batch adds simulator rows)."""
        if batch.shape[0] == len(layout.rows) != layout.size:
            return jax.tree.map(layout.to_global, batch)
        return shard_batch(batch, shardings)

    def _copy_metrics(self, params) -> dict[str, float]:
        """Teacher-forced accuracy on held-out demonstrations (`train.diagnostics`): does the
        policy copy ids and amounts yet? Single-process runs only (the probe batch is a host
        array, not a global one)."""
        if jax.process_count() > 1:
            return {}
        if self._probe is None:
            tasks = self.eval_tasks[: self.config.eval.probe_tasks]
            buckets = self.config.rollout.length_buckets
            self._probe = held_out_probe(self.domain, tasks, self.tokenizer, buckets)
        sh = self.sft_shardings
        with jax.set_mesh(sh.mesh), parallel.axis_rules(sh.rules):
            return copy_metrics(nnx.merge(self.graphdef, params, self.rest), self._probe)

    def _end_warm_start(self, step: int, state, meta: dict[str, Any]) -> tuple[Any, dict]:
        """Evaluates the warm start (or takes over the evaluation of the run it was loaded
        from), keeps it in warm_start/, and opens the RL phase with a fresh optimizer."""
        ev = None
        if meta.get("warm_start_eval"):  # evaluated by the run it was loaded from
            ev = eval_from_dict(meta["warm_start_eval"])
        elif not self.rl_steps:  # the final policy: evaluated under the final evaluation's key
            with self._timed("eval_warm_start"):
                ev = self.evaluate(state.params, self.eval_tasks, self._final_eval_key)
        elif self.config.schedule.eval_warm_start:
            with self._timed("eval_warm_start"):
                key = jax.random.fold_in(self.eval_key, 0)
                ev = self.evaluate(state.params, self.eval_tasks, key)
        warm = {k: meta[k] for k in ("warm_start_dir",) if k in meta}
        meta = {"phase": "rl", "sft_eval": ev and ev.as_dict(), **warm}
        if ev is not None:
            self.writer.write(0, "eval", ev.as_dict(), global_step=step)
            print(f"[eval] warm start: {ev.line()}")
        if self.config.rehearsal.keep_warm_start:
            self.run_dir.keep_warm_start(step, state.params, meta)
        if self.rl_steps:
            state = self.fresh_state(state.params, "rl")
            self._save(step, state, {**meta, "data_position": 0})  # the RL phase's start
        return state, meta

    # --------------------------------------------------------------------------------- RL

    def rollouts(self, params, tasks, key, sampling: SamplingParams):
        """The RL phase's judged training batch for `tasks`, by `config.mode` (`strategies`)."""
        return self.mode.rollouts(params, tasks, key, sampling)

    def _run_rl(self, state: TrainState, start: int, meta: dict[str, Any]) -> TrainState:
        r, s = self.config.rollout, self.config.schedule
        rl_start = start - self.sft_steps
        stream = TaskStream(
            range(len(self.train_tasks)), self.config.seed + 1, position=rl_start * r.tasks_per_step
        )
        sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p)
        ref = (self._kl_reference(state, rl_start),) if self.config.grpo.use_kl else ()

        def step(state, i):
            g = self.sft_steps + i
            t0, calls = time.time(), self.rl_envs.calls
            tasks = [self.rl_tasks[k] for k in stream.next_indices(r.tasks_per_step)]
            rb = self.rollouts(state.params, tasks, jax.random.fold_in(self.key, g), sampling)
            t1 = time.time()
            batch = self._global_batch(rb.batch, self.rl_layout, self.rl_shardings)
            state, metrics = self.grpo_step(state, batch, *ref)
            m = {k: float(v) for k, v in metrics.items()}
            m.update({f"rollout_{k}": v for k, v in rb.stats.items()})
            m.update(rollout_s=t1 - t0, update_s=time.time() - t1)
            m["env_calls"] = self.rl_envs.calls - calls
            return state, m

        def shown(state, i, m):
            out = {"reward": m["rollout_reward"], "loss": m["loss"]}
            if "rollout_judge_error_share" in m:  # a judge that fails shows, even under the bar
                out["judge_err"] = m["rollout_judge_error_share"]
            return out

        def after(state, i):
            if s.eval_every and i % s.eval_every == 0 and i < self.rl_steps:
                g = self.sft_steps + i
                curve = not self.config.eval.curve_avg4
                key = jax.random.fold_in(self.eval_key, g)
                with self._timed(f"eval_rl_step_{i}"):
                    ev = self.evaluate(state.params, self.eval_tasks, key, greedy_only=curve)
                self.writer.write(i, "eval", ev.as_dict(), global_step=g)
                print(f"[eval] RL step {i}: {ev.line()}")

        phase = Phase(
            name="rl",
            what="RL",
            title=f"RL {self.config.mode}",
            offset=self.sft_steps,
            steps=self.rl_steps,
            step=step,
            logs=lambda i: True,
            shown=shown,
            after=after,
            meta=lambda i: {**meta, "phase": "rl", "data_position": stream.position},
        )
        return self._loop(phase, state, rl_start)

    def _kl_reference(self, state, rl_start: int):
        """The KL penalty's reference policy: the warm start's params (a copy of the state's at
        the start of RL, else the copy kept in warm_start/ when the run resumes mid-RL)."""
        if rl_start == 0:
            return frozen_copy(self.mode.act_params(state.params))
        target = params_target(nnx.state(self.model, nnx.Param), self.mesh)
        return self.run_dir.kept_warm_start(self.sft_steps, target, "grpo.use_kl: resuming RL")

    # -------------------------------------------------------------------------- evaluation

    def evaluate(self, params, tasks, key, greedy_only: bool = False):
        """Committed execution of `tasks` in the real environment by the ACT params (greedy and
        avg@4, `train.evaluation`), and the fidelity of the REHEARSE player (whoever rehearses
        in this mode); or, `eval.kind` 'checklist', the judge's checklist score of rehearsed
        episodes (avg@k, pass@k; `greedy_only` does not apply)."""
        if self.eval_kind == "checklist":
            return evaluation.checklist_evaluate(
                self.mode.rehearsals(params),
                tasks,
                self.config.eval,
                self.config.rollout.length_buckets,
                key,
            )
        return evaluation.evaluate(
            self.mode.host(params),
            self.mode.rehearsals(params),
            self.tokenizer,
            tasks,
            self.domain.make_env,
            self.mesh,
            self.config.eval,
            self.config.rollout.length_buckets,
            key,
            greedy_only,
        )

    # ------------------------------------------------------------------ state and checkpoints

    def fresh_state(self, params, phase: str) -> Any:
        if phase == "sft":
            return init_train_state(params, self.sft_tx, self.sft_shardings)
        return self.mode.rl_state(params, self.rl_tx, self.rl_shardings)

    def abstract_state(self, phase: str) -> Any:
        """The restore target of this run's state in `phase` ('sft' or 'rl')."""
        tx, sh = (
            (self.sft_tx, self.sft_shardings) if phase == "sft" else (self.rl_tx, self.rl_shardings)
        )
        state = abstract_train_state(nnx.state(self.model, nnx.Param), tx, sh.state)
        return state if phase == "sft" else self.mode.abstract_rl_state(state)

    def _step_boundary(self) -> None:
        """Where the run stops for a failed background save or a SIGINT a library swallowed."""
        self.run_dir.checkpointer.check()
        interrupts.check()

    def _save(self, global_step: int, state, meta: dict[str, Any]) -> None:
        self.run_dir.save(global_step, state, meta)
        self.hooks.on_checkpoint(global_step, state, meta)

    def restore(self) -> tuple[int, Any, dict[str, Any]]:
        """The newest readable checkpoint, or (0, None, {})."""
        target = lambda step, meta: self.abstract_state(
            phase_at(step, self.sft_steps, self.rl_steps)
        )
        step, state, meta = self.run_dir.latest(target)
        if state is not None:
            print(f"resuming from checkpoint {step} ({meta.get('phase')})")
            if self.writer.enabled:
                truncate_metrics(self.writer.path, step)
        return step, state, meta

    def load_warm_start(self, workdir: str) -> tuple[int, TrainState, dict[str, Any]]:
        """The finished warm start of another run (`RunDir.warm_start_of`), so that several
        modes, or a longer RL phase, start from the same parameters."""
        params = nnx.state(self.model, nnx.Param)
        found, meta = self.run_dir.warm_start_of(workdir, self.sft_steps, params, self.mesh)
        print(f"warm start loaded from {found.source}")
        return found.step, self.fresh_state(found.params, "sft"), meta

    def _times(self) -> dict[str, float]:
        """Seconds by part; 'rl' is the RL steps without the evaluations between them."""
        times = dict(self.times)
        if "rl" in times:
            between = sum(v for k, v in times.items() if k.startswith("eval_rl_step_"))
            times["rl"] -= between
        return {k: round(v, 1) for k, v in times.items()}

    def _finish(self, state, sft_eval: dict, final, seconds: float) -> dict[str, Any]:
        """Exports the policy (every process takes part) and writes the report (process 0)."""
        self.hooks.on_finish(state)
        for name, params in self.mode.exports(state.params).items():
            model = nnx.merge(self.graphdef, params, self.rest)
            self.run_dir.export(name, model, self.tokenizer)
        if self.writer.enabled:
            trained = f"RL ({self.config.mode})" if self.rl_steps else "final (no RL steps)"
            warm = eval_from_dict(sft_eval) if sft_eval else None
            args = (warm, final, trained, self.config.mode, self.eval_tasks, seconds)
            report.write_report(self.workdir, self.writer.path, *args, times=self._times())
        self.writer.close()
        self.run_dir.close()
        self.judge.close()
        return {"sft": sft_eval, "final": final.as_dict(), "seconds": seconds}
