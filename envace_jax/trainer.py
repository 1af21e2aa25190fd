"""The EnvACE training loop: warm-start SFT -> world-rehearsal RL -> real-environment evaluation.

    Trainer(config, workdir).run()

1. **Warm start.** Cross-entropy on oracle demonstrations of the training tasks, both roles: the
   agent's messages (ACT) and the real environment's responses (REHEARSE targets).
2. **RL.** Per step: `rollout.tasks_per_step` tasks x `rollout.group_size` trajectories, judged
   by the rule judge, then one role-wise GRPO update. `config.mode` picks the rollouts and the
   parameters (`rollout.modes`): 'envace' (the default) is world rehearsal by the shared policy,
   with no environment; the baselines run through this same loop. A warm start can also be
   loaded from another run's workdir (`schedule.warm_start_dir`), so modes share one.
3. **Evaluation** of committed execution in the real environment on held-out tasks (after the
   warm start, every `schedule.eval_every` RL steps, and at the end): success, reward, tool-error
   rate, and rehearsal fidelity (rehearsed responses equal to the real environment's).

Global step numbering: warm-start steps are 1..S, RL steps S+1..S+R, so one checkpoint sequence
covers both phases. Every random draw is keyed by (seed, global step), and data positions are a
function of the step, so a run resumed from a checkpoint ends with the same parameters as one
that never stopped.

Multi-host (one process per TPU host, `jax.distributed` initialised by `main`): one global mesh
for the steps and the samplers; each process builds, samples, judges and evaluates only the rows
of each global batch its devices hold (`parallel.RowLayout`), checkpoints go to
`schedule.checkpoint_dir` (shared, e.g. gs://) with every process writing its shards, and
metrics, plots, the summary and the HF export come from process 0.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx, struct

from envace_jax import checkpoint as ckpt_lib
from envace_jax import evaluation, parallel
from envace_jax.build import build_mesh, build_model, build_tokenizer
from envace_jax.configuration import step_configs
from envace_jax.data.stream import TaskStream, length_grouped_batch
from envace_jax.diagnostics import build_copy_probe, copy_metrics
from envace_jax.envs.demo import DemoEnv, demonstrations, generate_tasks, response_tools
from envace_jax.evaluation import EvalResult
from envace_jax.metrics import (
    MetricsWriter,
    Progress,
    plot_curves,
    read_metrics,
    table,
    truncate_metrics,
)
from envace_jax.models.hf_io import save_hf_model
from envace_jax.rl.batch import bucket_length, from_numpy, pad_to_bucket
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
from envace_jax.rollout.memory import memory_demonstrations
from envace_jax.rollout.modes import mode_spec, real_env_group_rollouts
from envace_jax.rollout.role_models import role_decoders, role_state
from envace_jax.rollout.world_rehearsal import RolloutBatch, rehearsal_rollouts
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler

WARM_START_DIR = "warm_start"  # workdir subdirectory holding the warm-start params


class TrainingDiverged(RuntimeError):
    """A loss or gradient norm was NaN or inf."""


@struct.dataclass
class RoleParams:
    """Parameters of modes whose roles have their own parameter sets."""

    act: Any
    rehearse: Any


@struct.dataclass
class RoleStates:
    """RL state of those modes: ACT's train state and REHEARSE's (trained in 'envace_noshare';
    frozen, with an empty optimizer state, in 'external_simulator')."""

    act: TrainState
    rehearse: TrainState

    @property
    def params(self) -> RoleParams:
        return RoleParams(self.act.params, self.rehearse.params)


class Trainer:
    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.config = config
        self.workdir = workdir
        self.steps_cfg = step_configs(config)
        self.mesh = build_mesh(config)
        self.tokenizer = build_tokenizer(config)
        self.model = build_model(config, self.tokenizer, self.mesh)
        self.graphdef, params, self.rest = nnx.split(self.model, nnx.Param, ...)
        self.key = jax.random.key(config.seed)
        self.eval_key = jax.random.fold_in(self.key, 2**31 - 1)  # a stream apart from training
        s = config.schedule
        self.mode = mode_spec(config.mode)
        self.sft_steps = s.sft_steps
        self.rl_steps = 0 if self.mode.rollout == "none" else s.rl_steps

        self.train_tasks = generate_tasks(config.seed, config.data.train_tasks, split="train")
        self.eval_tasks = generate_tasks(config.seed, config.data.eval_tasks, split="validation")
        self.make_env = DemoEnv
        self.pad_id = self.tokenizer.pad_token_id

        r = config.rollout
        rl_rows = r.group_size * r.tasks_per_step
        self.sft_tx = make_optimizer(self.steps_cfg["sft_optim"])
        self.rl_tx = make_optimizer(self.steps_cfg["optim"])
        longest = max(r.length_buckets)
        self.sft_shardings = make_shardings(
            self.mesh, params, self.sft_tx, (s.sft_batch_size, longest)
        )
        self.rl_shardings = make_shardings(self.mesh, params, self.rl_tx, (rl_rows, longest))
        self.sft_step = make_sft_step(
            self.model, self.sft_tx, self.steps_cfg["sft"], shardings=self.sft_shardings
        )
        self.grpo_step = self._make_grpo_step()
        common = dict(max_turns=r.max_turns, max_message_tokens=r.max_message_tokens)
        rehearse_spec = turn_spec(self.tokenizer, mode="rehearse", **common)
        rehearser = self.model
        if self.mode.role_params:  # one loop, ACT and REHEARSE tokens from their own params
            rehearser = role_decoders(self.graphdef, params, params, rehearse_spec)
        self.rehearse_sampler = Sampler(rehearser, rehearse_spec, pad_id=self.pad_id)
        self.host_sampler = Sampler(
            self.model, turn_spec(self.tokenizer, mode="host", **common), pad_id=self.pad_id
        )
        # Checkpoints (and the kept warm start beside them) go where every process can write:
        # schedule.checkpoint_dir (e.g. gs://...) when the processes have a workdir each.
        checkpoints = s.checkpoint_dir.rstrip("/") or os.path.join(workdir, "checkpoints")
        self.warm_start_keep_dir = os.path.join(os.path.dirname(checkpoints), WARM_START_DIR)
        self.checkpointer = ckpt_lib.Checkpointer(checkpoints, keep=s.keep_checkpoints)
        self.writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
        # Multi-host: the rows of each global batch this process builds (every row on one host).
        self.sft_layout = parallel.row_layout(self.mesh, s.sft_batch_size)
        self.rl_layout = parallel.row_layout(self.mesh, rl_rows)
        self._demos = None
        self._probe = None

    def _make_grpo_step(self):
        """`step(state, batch) -> (state, metrics)` of the mode. With a parameter set per role,
        each set's step trains only its role's tokens (role-wise advantages are per role, so
        this is the shared objective split by role); a frozen rehearser is never updated."""
        cfg = self.steps_cfg["grpo"]
        make = lambda c: make_grpo_step(self.model, self.rl_tx, c, shardings=self.rl_shardings)
        if not self.mode.role_params:
            return make(cfg)
        act_step = make(dataclasses.replace(cfg, train_roles=("act",)))
        rehearse_step = None
        if self.mode.rehearser == "separate":
            rehearse_step = make(dataclasses.replace(cfg, train_roles=("rehearse",)))
        return functools.partial(_role_grpo_step, act_step, rehearse_step)

    # ------------------------------------------------------------------ state and checkpoints

    def _phase_of(self, global_step: int) -> str:
        return "sft" if global_step < self.sft_steps or self.rl_steps == 0 else "rl"

    def _fresh_state(self, params, phase: str) -> TrainState | RoleStates:
        if phase == "sft":
            return init_train_state(params, self.sft_tx, self.sft_shardings)
        act = init_train_state(params, self.rl_tx, self.rl_shardings)
        if not self.mode.role_params:
            return act
        # Its own buffers: each set's step donates its state.
        rehearse = frozen_copy(params)
        if self.mode.rehearser == "separate":
            return RoleStates(act, init_train_state(rehearse, self.rl_tx, self.rl_shardings))
        step = jax.device_put(jnp.zeros((), jnp.int32), self.rl_shardings.replicated)
        return RoleStates(act, TrainState(step, rehearse, optax.EmptyState()))

    def _abstract_state(self, phase: str) -> TrainState | RoleStates:
        tx, sh = (
            (self.sft_tx, self.sft_shardings) if phase == "sft" else (self.rl_tx, self.rl_shardings)
        )
        params = nnx.state(self.model, nnx.Param)
        shapes = jax.eval_shape(
            lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p)),
            params,
        )
        state = jax.tree.map(
            lambda s, shard: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shard),
            shapes,
            sh.state,
        )
        if phase == "sft" or not self.mode.role_params:
            return state
        if self.mode.rehearser == "separate":
            return RoleStates(state, state)
        return RoleStates(state, TrainState(state.step, state.params, optax.EmptyState()))

    def _save(self, global_step: int, state: TrainState, meta: dict[str, Any]) -> None:
        config = json.loads(json.dumps(self.config.to_dict()))  # tuples -> lists, as JSON has
        meta = dict(meta, global_step=global_step, config=config)
        self.checkpointer.save(global_step, state, meta)

    def _restore(self) -> tuple[int, TrainState | None, dict[str, Any]]:
        """The newest readable checkpoint; a corrupt one is skipped with a warning (in step with
        every process of a multi-host run)."""
        if self.checkpointer.latest_step() is None:
            return 0, None, {}
        step, state, meta = self.checkpointer.restore(
            lambda step, meta: self._abstract_state(self._phase_of(step))
        )
        print(f"resuming from checkpoint {step} ({meta.get('phase')})")
        if self.writer.enabled:
            truncate_metrics(self.writer.path, step)
        return step, state, meta

    # Config sections that make two warm starts the same computation (the seed may differ: it
    # then seeds this run's RL phase and held-out tasks only).
    _WARM_START_KEYS = ("tokenizer", "model", "data", "sft", "sft_optim")

    def _load_warm_start(self, workdir: str) -> tuple[int, TrainState, dict[str, Any]]:
        """The finished warm start of another run, so that several modes, or a longer RL
        phase, start from the same parameters: its checkpoint at step schedule.sft_steps when
        that run stopped there (rl_steps=0, or mode 'sft_only'), else the warm start that a
        train job keeps in warm_start/ (`rehearsal.keep_warm_start`). Its evaluation is reused
        when this run evaluates the same way (same seed and eval settings). Raises naming what
        does not match this config."""
        where = f"config.schedule.warm_start_dir={workdir!r}"
        if not os.path.isdir(workdir):
            raise ValueError(f"{where}: no such directory")
        directory = os.path.join(workdir, "checkpoints")  # a workdir, or its checkpoints/
        directory = directory if os.path.isdir(directory) else workdir.rstrip("/")
        loaded, unreadable = None, ""
        with ckpt_lib.Checkpointer(directory, keep=1) as ckpt:
            found = ckpt.all_steps()
            # A train job's step sft_steps opens its RL phase: only a finished run's is read.
            if self.sft_steps in found:
                try:
                    meta = ckpt.read_meta(self.sft_steps)
                    if meta.get("phase") == "done" and "sft_eval" in meta:
                        loaded = ckpt.restore(
                            lambda step, meta: self._abstract_state("sft"), step=self.sft_steps
                        )
                except ckpt_lib.CheckpointError as e:  # the kept copy below may still be whole
                    unreadable = f"; the checkpoint there is unreadable: {e}"
                    print(f"warning: {where}{unreadable}; looking in {WARM_START_DIR}/")
        kept = os.path.join(os.path.dirname(directory), WARM_START_DIR)
        if loaded is None and os.path.isdir(kept):
            with ckpt_lib.Checkpointer(kept, keep=1) as keeper:
                if self.sft_steps in keeper.all_steps():
                    step, params, meta = keeper.restore(
                        lambda step, meta: self._abstract_state("sft").params, step=self.sft_steps
                    )
                    loaded = step, self._fresh_state(params, "sft"), meta
        if loaded is None:
            raise ValueError(
                f"{where}: no checkpoint at the end of a {self.sft_steps}-step warm start "
                f"(found steps {found}; a run with rl_steps=0 or mode='sft_only' ends on one) "
                f"and no such step in {WARM_START_DIR}/ (a train job keeps its warm start "
                f"there){unreadable}"
            )
        step, state, meta = loaded
        ours = json.loads(json.dumps(self.config.to_dict()))
        theirs = meta.get("config", {})
        differ = [k for k in self._WARM_START_KEYS if ours.get(k) != theirs.get(k)]
        s_ours, s_theirs = ours["schedule"], theirs.get("schedule", {})
        differ += [
            f"schedule.{k}" for k in ("sft_steps", "sft_batch_size") if s_ours[k] != s_theirs.get(k)
        ]
        if differ:
            raise ValueError(f"{where}: that warm start was run with other {', '.join(differ)}")
        print(f"warm start loaded from {workdir} (step {step})")
        meta_out = {"warm_start_dir": workdir}
        if all(ours[k] == theirs.get(k) for k in ("seed", "eval")):
            meta_out["warm_start_eval"] = meta["sft_eval"]
        return step, state, meta_out

    @staticmethod
    def _check_finite(metrics: dict[str, float], phase: str, step: int, last_good) -> None:
        bad = [k for k in ("loss", "grad_norm") if k in metrics and not math.isfinite(metrics[k])]
        if bad:
            raise TrainingDiverged(
                f"{phase} step {step}: {', '.join(f'{k}={metrics[k]}' for k in bad)}; stopping "
                f"without saving. The last good checkpoint is step {last_good}."
            )

    def _keep_warm_start(self, step: int, params, meta: dict[str, Any]) -> None:
        """Saves the warm-start params (global step `step`) in warm_start/ beside the checkpoint
        directory (workdir/warm_start/ by default), apart from the rotating checkpoints:
        test-time rehearsal evaluates them as a rehearser."""
        keeper = ckpt_lib.Checkpointer(self.warm_start_keep_dir, keep=1, async_save=False)
        config = json.loads(json.dumps(self.config.to_dict()))
        try:
            keeper.save(step, params, {**meta, "phase": "warm_start", "config": config})
        finally:
            keeper.close()

    # --------------------------------------------------------------------------- warm start

    def sft_examples(self) -> list:
        """Warm-start sequences (`text.trajectory.EncodedConversation`), one per training task:
        its oracle conversation, actions as ACT and the real environment's responses as
        REHEARSE targets; a share `data.failure_demos` shows a failing call and its recovery
        (`envs.demo.oracle.recovery_messages`). For a fraction `rehearsal.sft_memory_fraction`
        of the tasks the prompt also carries a rehearsal memory (exact, or partly wrong so that
        the policy learns to check it; `rollout.memory`), which test-time rehearsal gives the
        committed run."""
        demos = demonstrations(
            self.train_tasks, self.tokenizer, self.config.data.failure_demos, self.config.seed
        )
        fraction = self.config.rehearsal.sft_memory_fraction
        if fraction > 0:
            with_memory = memory_demonstrations(
                self.train_tasks,
                self.tokenizer,
                self.make_env,
                fraction=fraction,
                seed=self.config.seed,
            )
            demos = [with_memory.get(i, d) for i, d in enumerate(demos)]
        return demos

    def _global_batch(self, batch, layout: parallel.RowLayout, shardings):
        """The step's global batch from host rows: this process's rows (`layout.rows`), or every
        row when a rollout mode builds the whole batch on every process."""
        if batch.shape[0] == layout.size:
            return shard_batch(batch, shardings)
        return jax.tree.map(layout.to_global, batch)

    def _sft_batch(self, indices: list[int]):
        """The warm-start batch of demonstrations `indices`; this process builds its rows only."""
        if self._demos is None:
            self._demos = self.sft_examples()
        layout = self.sft_layout
        rows = [self._demos[indices[i] % len(self._demos)] for i in layout.rows]
        T = max(len(r.ids) for r in rows)
        tokens = np.full((len(rows), T), self.pad_id, np.int32)
        roles = np.zeros((len(rows), T), np.int8)
        segments = np.zeros((len(rows), T), np.int32)
        for b, r in enumerate(rows):
            n = len(r.ids)
            tokens[b, :n], roles[b, :n], segments[b, :n] = r.ids, r.roles, r.segments
        batch = from_numpy(
            tokens=tokens,
            roles=roles,
            segments=segments,
            lengths=[len(r.ids) for r in rows],
            group=layout.rows,
            reward=np.zeros(len(rows)),
        )
        longest = parallel.process_max(T)  # every process pads to the same bucket
        bucket = bucket_length(longest, self.config.rollout.length_buckets)
        batch = pad_to_bucket(batch, (bucket,), pad_id=self.pad_id)
        return self._global_batch(batch, layout, self.sft_shardings)

    def _run_sft(self, state: TrainState, start: int) -> TrainState:
        s = self.config.schedule
        if self._demos is None:
            self._demos = self.sft_examples()
        lengths = [len(d.ids) for d in self._demos]
        progress = Progress("warm start", self.sft_steps, start)
        last_good = start
        for step in range(start + 1, self.sft_steps + 1):
            self.checkpointer.check()  # a failed background save stops the run here
            indices = length_grouped_batch(
                lengths, self.config.seed, step - 1, s.sft_batch_size, s.sft_length_window
            )
            batch = self._sft_batch(indices)
            state, metrics = self.sft_step(state, batch)
            if step % s.log_every == 0 or step == self.sft_steps:
                m = {k: float(v) for k, v in metrics.items()}
                self._check_finite(m, "warm-start", step, last_good)
                shown = {"loss": m["loss"], "nll": m["nll"]}
                if s.probe_every and (step % s.probe_every == 0 or step == self.sft_steps):
                    probe = self._copy_metrics(state.params)
                    m.update(probe)
                    # The bar shows the three headline scores; the per-tool ones go to the logs.
                    shown.update(
                        {k.split("/")[1]: v for k, v in probe.items() if k.count("/") == 1}
                    )
                self.writer.write(step, "sft", m)
                progress.update(step, **shown)
            if step % s.checkpoint_every == 0 and step < self.sft_steps:
                m = {k: float(v) for k, v in metrics.items()}
                self._check_finite(m, "warm-start", step, last_good)
                self._save(step, state, {"phase": "sft", "data_position": step * s.sft_batch_size})
                last_good = step
        return state

    def _copy_metrics(self, params) -> dict[str, float]:
        """Teacher-forced accuracy on held-out demonstrations (`envace_jax.diagnostics`): does
        the policy copy ids and amounts yet? Single-process runs only (the probe batch is a
        host array, not a global one)."""
        if jax.process_count() > 1:
            return {}
        if self._probe is None:
            tasks = self.eval_tasks[: self.config.eval.probe_tasks]
            examples = demonstrations(tasks, self.tokenizer)
            longest = max(len(e.ids) for e in examples)
            length = bucket_length(longest, self.config.rollout.length_buckets)
            tools = response_tools(tasks)
            self._probe = build_copy_probe(examples, self.tokenizer, self.pad_id, length, tools)
        sh = self.sft_shardings
        with jax.set_mesh(sh.mesh), parallel.axis_rules(sh.rules):
            return copy_metrics(nnx.merge(self.graphdef, params, self.rest), self._probe)

    # -------------------------------------------------------------------------- evaluation

    def _act_params(self, params):
        return params.act if isinstance(params, RoleParams) else params

    def _rehearsal_params(self, params):
        """The rehearse sampler's params: the policy's, or both role sets (a single set, e.g.
        the warm start's, plays both roles)."""
        if not self.mode.role_params:
            return params
        if isinstance(params, RoleParams):
            return role_state(params.act, params.rehearse)
        return role_state(params, params)

    def evaluate(self, params, tasks, key) -> EvalResult:
        """Committed execution of `tasks` in the real environment by the ACT params (greedy and
        avg@4, `envace_jax.evaluation`), and the fidelity of the REHEARSE player (whoever
        rehearses in this mode)."""
        self.host_sampler.set_params(self._act_params(params))
        self.rehearse_sampler.set_params(self._rehearsal_params(params))
        return evaluation.evaluate(
            self.host_sampler,
            self.rehearse_sampler,
            self.tokenizer,
            tasks,
            self.make_env,
            self.mesh,
            self.config.eval,
            self.config.rollout.length_buckets,
            key,
        )

    # --------------------------------------------------------------------------------- RL

    def rollouts(self, params, tasks, key, sampling: SamplingParams) -> RolloutBatch:
        """The RL phase's judged training batch for `tasks`, by `config.mode`
        (`rollout.modes`): world rehearsal (by the policy, by a policy per role, or with a
        frozen simulator), or host turns in the real environment."""
        r = self.config.rollout
        if self.mode.rollout == "real_env":
            self.host_sampler.set_params(self._act_params(params))
            return real_env_group_rollouts(
                self.host_sampler,
                self.tokenizer,
                tasks,
                self.make_env,
                group_size=r.group_size,
                key=key,
                sampling=sampling,
                max_new_tokens=r.max_new_tokens,
                length_buckets=r.length_buckets,
            )
        self.rehearse_sampler.set_params(self._rehearsal_params(params))
        return rehearsal_rollouts(
            self.rehearse_sampler,
            self.tokenizer,
            tasks,
            group_size=r.group_size,
            key=key,
            sampling=sampling,
            max_new_tokens=r.max_new_tokens,
            length_buckets=r.length_buckets,
            layout=self.rl_layout,
        )

    def _run_rl(self, state: TrainState, start: int, meta: dict[str, Any]) -> TrainState:
        r, s = self.config.rollout, self.config.schedule
        rl_start = start - self.sft_steps
        stream = TaskStream(
            range(len(self.train_tasks)), self.config.seed + 1, position=rl_start * r.tasks_per_step
        )
        sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p)
        ref = (self._kl_reference(state, rl_start),) if self.steps_cfg["grpo"].use_kl else ()
        progress = Progress(f"RL {self.config.mode}", self.rl_steps, rl_start)
        last_good = start
        for rl_step in range(rl_start + 1, self.rl_steps + 1):
            self.checkpointer.check()  # a failed background save stops the run here
            g = self.sft_steps + rl_step
            t0 = time.time()
            tasks = [self.train_tasks[i] for i in stream.next_indices(r.tasks_per_step)]
            rb = self.rollouts(state.params, tasks, jax.random.fold_in(self.key, g), sampling)
            t1 = time.time()
            batch = self._global_batch(rb.batch, self.rl_layout, self.rl_shardings)
            state, metrics = self.grpo_step(state, batch, *ref)
            m = {k: float(v) for k, v in metrics.items()}
            self._check_finite(m, "RL", g, last_good)
            m.update({f"rollout_{k}": v for k, v in rb.stats.items()})
            m.update(rollout_s=t1 - t0, update_s=time.time() - t1)
            self.writer.write(rl_step, "rl", m, global_step=g)
            progress.update(rl_step, reward=rb.stats["reward"], loss=m["loss"])
            if s.eval_every and rl_step % s.eval_every == 0 and rl_step < self.rl_steps:
                ev = self.evaluate(
                    state.params, self.eval_tasks, jax.random.fold_in(self.eval_key, g)
                )
                self.writer.write(rl_step, "eval", ev.as_dict(), global_step=g)
                print(f"[eval] RL step {rl_step}: {ev.headline()}")
            if rl_step % s.checkpoint_every == 0 and rl_step < self.rl_steps:
                self._save(g, state, {**meta, "phase": "rl", "data_position": stream.position})
                last_good = g
        return state

    def _kl_reference(self, state, rl_start: int):
        """The KL penalty's reference policy: the warm start's params (a copy of the state's at
        the start of RL, else the copy kept in warm_start/ when the run resumes mid-RL)."""
        if rl_start == 0:
            return frozen_copy(self._act_params(state.params))
        keep = self.warm_start_keep_dir
        if not os.path.isdir(keep):
            raise ValueError(
                f"grpo.use_kl: resuming RL needs the warm start kept in {keep} "
                "(config.rehearsal.keep_warm_start=True)"
            )
        with ckpt_lib.Checkpointer(keep, keep=1) as keeper:
            _, params, _ = keeper.restore(
                lambda step, meta: self._abstract_state("sft").params, step=self.sft_steps
            )
        return params

    # ------------------------------------------------------------------------------- run

    def run(self, force: bool = False) -> dict[str, Any]:
        """Trains, or resumes from the newest readable checkpoint. A finished run (its final
        checkpoint restored) only writes its outputs again; `force` redoes its evaluation."""
        t_start = time.time()
        step, state, meta = self._restore()
        if meta.get("phase") == "done" and step == self.sft_steps + self.rl_steps and not force:
            print(f"the run is complete (step {step}); --force redoes its final evaluation")
            final = EvalResult.from_dict(meta["final_eval"])
            return self._finish(state, meta["sft_eval"], final, 0.0)
        if state is None and self.config.schedule.warm_start_dir:
            step, state, meta = self._load_warm_start(self.config.schedule.warm_start_dir)
        if state is None:
            state = self._fresh_state(nnx.state(self.model, nnx.Param), "sft")
        if step < self.sft_steps:
            state = self._run_sft(state, step)
            step = self.sft_steps
        if "sft_eval" not in meta:
            if "warm_start_eval" in meta:  # evaluated by the run it was loaded from
                ev = EvalResult.from_dict(meta["warm_start_eval"])
            else:
                ev = self.evaluate(
                    state.params, self.eval_tasks, jax.random.fold_in(self.eval_key, 0)
                )
            warm = {k: meta[k] for k in ("warm_start_dir",) if k in meta}
            meta = {"phase": "rl", "sft_eval": ev.as_dict(), **warm}
            self.writer.write(0, "eval", ev.as_dict(), global_step=step)
            print(f"[eval] warm start: {ev.headline()}")
            if self.config.rehearsal.keep_warm_start:
                self._keep_warm_start(step, state.params, meta)
            if self.rl_steps:
                # The RL phase starts from a fresh optimizer; checkpoint that boundary.
                state = self._fresh_state(state.params, "rl")
                self._save(step, state, {**meta, "data_position": 0})
        if self.rl_steps:
            state = self._run_rl(state, step, meta)
        final = self.evaluate(
            state.params, self.eval_tasks, jax.random.fold_in(self.eval_key, 2**30)
        )
        last = self.sft_steps + self.rl_steps
        self.writer.write(self.rl_steps, "eval", final.as_dict(), global_step=last)
        self._save(
            self.sft_steps + self.rl_steps,
            state,
            {**meta, "phase": "done", "final_eval": final.as_dict()},
        )
        self.checkpointer.wait()
        return self._finish(state, meta["sft_eval"], final, time.time() - t_start)

    def _finish(self, state, sft_eval: dict, final: EvalResult, seconds: float) -> dict[str, Any]:
        primary = self.writer.enabled  # process 0 writes the outputs; all take part in the export
        if primary:
            plot_curves(
                read_metrics(self.writer.path),
                os.path.join(self.workdir, "curves.png"),
                [
                    ("rl", "rollout_reward", "rollout reward (train)"),
                    ("eval", "success", "real-env success (held out)"),
                    ("eval", "fidelity", "rehearsal fidelity (held out)"),
                ],
            )
        # With no RL steps the final row is the warm start evaluated again (other sample key).
        trained = f"RL ({self.config.mode})" if self.rl_steps else "final (no RL steps)"
        warm = EvalResult.from_dict(sft_eval)
        summary = summary_tables(warm, final, trained, self.eval_tasks)
        summary_json = {
            "tasks": len(self.eval_tasks),
            "mode": self.config.mode,
            **{name: summary_record(ev) for name, ev in (("warm_start", warm), ("final", final))},
        }
        # export/ holds the acting policy; a trained REHEARSE set goes to export_rehearse/.
        exports = {"export": self._act_params(state.params)}
        if self.mode.rehearser == "separate":
            exports["export_rehearse"] = state.params.rehearse
        for name, params in exports.items():
            model = nnx.merge(self.graphdef, params, self.rest)
            save_hf_model(
                model, model.cfg, os.path.join(self.workdir, name), tokenizer=self.tokenizer
            )
        if primary:
            with open(os.path.join(self.workdir, "summary.md"), "w") as f:
                f.write(summary + "\n")
            with open(os.path.join(self.workdir, "summary.json"), "w") as f:
                json.dump(summary_json, f, indent=1)
            tasks = len(self.eval_tasks)
            print(f"\nHeld-out real-environment evaluation ({tasks} tasks):\n{summary}")
            outputs = (
                "metrics.jsonl, tensorboard/, curves.png, summary.md, summary.json, "
                "checkpoints/, export/"
            )
            print(f"\nworkdir: {self.workdir} ({outputs})")
            print(f"total time {seconds:.0f}s")
        self.writer.close()
        self.checkpointer.close()
        return {"sft": sft_eval, "final": final.as_dict(), "seconds": seconds}


def summary_record(ev: EvalResult) -> dict[str, float]:
    """The headline numbers of one evaluation, as summary.json keeps them."""
    return {
        "success_greedy": ev.success,
        "success_greedy_se": ev.success_se,
        "success_avg4": ev.success_avg4,
        "success_avg4_se": ev.success_avg4_se,
        "reward": ev.reward,
        "fidelity": ev.fidelity,
    }


def summary_tables(warm: EvalResult, final: EvalResult, trained: str, tasks) -> str:
    """summary.md: the headline table (greedy and avg@4 with their standard errors), then
    success per task family."""
    pm = lambda v, se: f"{v:.3f} ± {se:.3f}"
    header = ["policy", "success (greedy)", "success (avg@4)", "reward", "tool errors"]
    header += ["invalid", "fidelity"]
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
        for name, ev in (("warm start (SFT)", warm), (trained, final))
    ]
    text = table(rows, header)
    if families := sorted({*warm.by_family, *final.by_family}):
        counts = collections.Counter(t.metadata.get("family") for t in tasks)
        get = lambda d, f: d.get(f, "-")
        rows = [
            [f, counts[f], get(warm.by_family, f), get(warm.by_family_avg4, f)]
            + [get(final.by_family, f), get(final.by_family_avg4, f)]
            for f in families
        ]
        header = ["task family", "tasks", "warm start greedy", "warm start avg@4"]
        header += [f"{trained} greedy", f"{trained} avg@4"]
        text += "\n\nSuccess by task family:\n\n" + table(rows, header)
    return text


def _role_grpo_step(act_step, rehearse_step, state: RoleStates, batch, *ref):
    """One GRPO update of each role's parameter set on the same batch (a frozen REHEARSE set,
    `rehearse_step` None, is passed through); `ref` is the KL reference when grpo.use_kl. The
    loss and gradient norm reported are those of both sets together."""
    act, metrics = act_step(state.act, batch, *ref)
    rehearse = state.rehearse
    if rehearse_step is not None:
        rehearse, m = rehearse_step(rehearse, batch, *ref)
        for k in ("loss", "grad_norm", "entropy", "pg_clipfrac", "trained_tokens"):
            metrics[f"rehearse_params/{k}"] = m[k]
        metrics["loss"] = metrics["loss"] + m["loss"]
        metrics["grad_norm"] = jnp.hypot(metrics["grad_norm"], m["grad_norm"])
    return RoleStates(act, rehearse), metrics
