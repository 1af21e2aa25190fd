"""What each training mode decides inside the one trainer loop (`envace_jax.modes` declares them).

A strategy owns the two samplers (host turns in the real environment; world rehearsal), and
answers the loop's mode questions: is there an RL phase, what is the RL state's layout, which
step updates it, who plays each role when sampling, where the RL batch comes from, what gets
exported. The loop asks; it never branches on the mode.

    SharedPolicy   'envace': one parameter set plays ACT and REHEARSE (the base of the others)
    GroundedPolicy 'envace' with rollout.rehearsal_view 'grounded': REHEARSE answers each call
                   from a simulator prompt of its own (`rollout.grounded`)
    WarmStartOnly  'sft_only': no RL phase
    RealEnvPolicy  'grpo_real_env': RL rollouts are host turns in the real environment
    CorruptedWorldPolicy  'corrupted_world': host turns against a corrupted copy of the world
    RolePolicies   'envace_noshare' (each role its own trained set), 'external_simulator'
                   (REHEARSE by a frozen copy of the warm start)

A new mode is a row of `envace_jax.modes` naming a class here (or anywhere): usually a
subclass of `SharedPolicy` that overrides `rollouts` and `rehearsals`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from envace_jax import parallel
from envace_jax.envs.base import CallCounter
from envace_jax.modes import Mode
from envace_jax.rl.steps import TrainState, frozen_copy, init_train_state
from envace_jax.rollout.grounded import grounded_rollouts
from envace_jax.rollout.real_env import real_env_group_rollouts
from envace_jax.rollout.role_models import role_decoders, role_state
from envace_jax.rollout.world_rehearsal import GroupSampling, RolloutBatch, rehearsal_rollouts
from envace_jax.sampling.chat_spec import turn_spec
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.sampler import Sampler


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


@dataclasses.dataclass(frozen=True)
class RolloutSetup:
    """What every strategy samples with: the model (its graph and initial params), the
    tokenizer, the domain's environment factory, `config.rollout` and this process's rows;
    `corrupted_envs(kind, rate, seed)` is the domain's factory of corrupted worlds (or None);
    `judge` scores world-rehearsal episodes (`rewards.judges`; None: the rule judge)."""

    model: nnx.Module
    tokenizer: Any
    make_env: Callable[[], Any]
    rollout: Any  # config.rollout
    layout: parallel.RowLayout  # the RL batch's rows this process builds
    corrupted_envs: Callable[[str, float, int], Callable[[], Any]] | None = None
    judge: Callable[..., Any] | None = None


class SharedPolicy:
    """'envace': world rehearsal by the policy, whose one parameter set plays both roles."""

    def __init__(self, row: Mode, setup: RolloutSetup):
        self.row, self.setup = row, setup
        r, tok = setup.rollout, setup.tokenizer
        common = dict(max_turns=r.max_turns, max_message_tokens=r.max_message_tokens)
        pad = tok.pad_token_id
        rehearse_spec = turn_spec(tok, mode="rehearse", **common)
        self.rehearse_sampler = Sampler(self.rehearser(rehearse_spec), rehearse_spec, pad_id=pad)
        self.host_sampler = Sampler(setup.model, turn_spec(tok, mode="host", **common), pad_id=pad)

    def rehearser(self, spec) -> nnx.Module:
        """The model of the rehearse sampler (its loop writes both roles)."""
        return self.setup.model

    def grpo_step(self, make: Callable[[Any], Callable], cfg) -> Callable:
        """`step(state, batch, *ref) -> (state, metrics)` from `make(GRPOConfig)`."""
        return make(cfg)

    def rl_state(self, params: Any, tx, shardings) -> Any:
        """The RL phase's fresh state from the warm start's `params`."""
        return init_train_state(params, tx, shardings)

    def abstract_rl_state(self, abstract: TrainState) -> Any:
        """The RL state's restore target from a single TrainState's."""
        return abstract

    def act_params(self, params: Any) -> Any:
        return params

    def rehearsal_params(self, params: Any) -> Any:
        """The rehearse sampler's params."""
        return params

    def host(self, params: Any) -> Sampler:
        """The host-turn sampler over `params`'s ACT player."""
        return self.host_sampler.with_params(self.act_params(params))

    def rehearsals(self, params: Any) -> Callable[..., RolloutBatch]:
        """`(tasks, group, layout=) -> RolloutBatch`: world-rehearsal episodes by `params`'s
        players in this mode's view (what fidelity is measured on)."""
        sampler = self.rehearse_sampler.with_params(self.rehearsal_params(params))
        return functools.partial(
            rehearsal_rollouts, sampler, self.setup.tokenizer, judge=self.setup.judge
        )

    def rollouts(self, params, tasks: Sequence[Any], key, sampling: SamplingParams) -> RolloutBatch:
        """The RL step's judged batch for `tasks` (`rollout.group_size` trajectories each)."""
        group = self._group(key, sampling)
        return rehearsal_rollouts(
            self.rehearse_sampler.with_params(self.rehearsal_params(params)),
            self.setup.tokenizer,
            tasks,
            group,
            layout=self.setup.layout,
            judge=self.setup.judge,
        )

    def _group(self, key, sampling: SamplingParams) -> GroupSampling:
        """The rollout settings every way of sampling a group shares."""
        r = self.setup.rollout
        return GroupSampling(
            group_size=r.group_size,
            key=key,
            sampling=sampling,
            max_new_tokens=r.max_new_tokens,
            length_buckets=r.length_buckets,
        )

    def exports(self, params: Any) -> dict[str, Any]:
        """Params to export by directory name: export/ holds the acting policy."""
        return {"export": self.act_params(params)}


class GroundedPolicy(SharedPolicy):
    """'envace', grounded view: the policy's host-turn sampler acts, and answers every call from
    a simulator prompt with the task's logged responses; the answers train as REHEARSE rows."""

    def rollouts(self, params, tasks: Sequence[Any], key, sampling: SamplingParams) -> RolloutBatch:
        return self.rehearsals(params)(tasks, self._group(key, sampling))

    def rehearsals(self, params: Any) -> Callable[..., RolloutBatch]:
        """Grounded rehearsal by `params` (built whole on every process: `layout` is unused)."""
        sampler = self.host(params)

        def rehearse(tasks, group: GroupSampling, layout=None) -> RolloutBatch:
            del layout
            return grounded_rollouts(
                sampler,
                self.setup.tokenizer,
                tasks,
                group,
                max_message_tokens=self.setup.rollout.max_message_tokens,
                judge=self.setup.judge,
            )

        return rehearse


class WarmStartOnly(SharedPolicy):
    """'sft_only': the warm start, no RL steps (its row's batch is 'none')."""


class RealEnvPolicy(SharedPolicy):
    """'grpo_real_env': GRPO on host turns in the real environment (observations as CONTEXT)."""

    def rollouts(self, params, tasks: Sequence[Any], key, sampling: SamplingParams) -> RolloutBatch:
        group = self._group(key, sampling)
        return real_env_group_rollouts(
            self.host(params), self.setup.tokenizer, tasks, self.setup.make_env, group
        )


class CorruptedWorldPolicy(SharedPolicy):
    """'corrupted_world': GRPO on host turns against a corrupted copy of the world (the
    sensitivity control); its calls are simulator calls (`sim_calls`), never the
    environment's. With `rollout.corruption_rate` 0 it samples what 'grpo_real_env' does."""

    def __init__(self, row: Mode, setup: RolloutSetup):
        if setup.corrupted_envs is None:
            raise ValueError("config.mode = 'corrupted_world': the domain has no corrupted world")
        super().__init__(row, setup)

    def rollouts(self, params, tasks: Sequence[Any], key, sampling: SamplingParams) -> RolloutBatch:
        r = self.setup.rollout
        # The corruption draws are keyed by the step's key, so a resumed run redraws the same.
        seed = int(np.asarray(jax.random.key_data(key)).ravel()[-1])
        world = CallCounter(self.setup.corrupted_envs(r.corruption, r.corruption_rate, seed))
        rb = real_env_group_rollouts(
            self.host(params), self.setup.tokenizer, tasks, world, self._group(key, sampling)
        )
        # Tool errors were the corrupted world's; its success test, against the task's true final
        # state, says nothing of a world whose state was redrawn.
        stats = {k.replace("real_", "sim_"): v for k, v in rb.stats.items() if k != "real_success"}
        return dataclasses.replace(rb, stats={**stats, "sim_calls": world.calls})


class RolePolicies(SharedPolicy):
    """A parameter set per role in one decode loop: REHEARSE trained on its own tokens
    ('envace_noshare') or frozen at the warm start ('external_simulator')."""

    def __init__(self, row: Mode, setup: RolloutSetup):
        self.train_rehearser = "rehearse" in row.trains
        super().__init__(row, setup)

    def rehearser(self, spec) -> nnx.Module:
        graphdef, params, _ = nnx.split(self.setup.model, nnx.Param, ...)
        return role_decoders(graphdef, params, params, spec)

    def grpo_step(self, make: Callable[[Any], Callable], cfg) -> Callable:
        """Each set's step trains only its role's tokens (role-wise advantages are per role,
        so this is the shared objective split by role); a frozen rehearser is never updated."""
        act_step = make(dataclasses.replace(cfg, train_roles=("act",)))
        rehearse_step = None
        if self.train_rehearser:
            rehearse_step = make(dataclasses.replace(cfg, train_roles=("rehearse",)))
        return functools.partial(_role_grpo_step, act_step, rehearse_step)

    def rl_state(self, params: Any, tx, shardings) -> RoleStates:
        act = init_train_state(params, tx, shardings)
        rehearse = frozen_copy(params)  # its own buffers: each set's step donates its state
        if self.train_rehearser:
            return RoleStates(act, init_train_state(rehearse, tx, shardings))
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.replicated)
        return RoleStates(act, TrainState(step, rehearse, optax.EmptyState()))

    def abstract_rl_state(self, abstract: TrainState) -> RoleStates:
        if self.train_rehearser:
            return RoleStates(abstract, abstract)
        return RoleStates(abstract, TrainState(abstract.step, abstract.params, optax.EmptyState()))

    def act_params(self, params: Any) -> Any:
        return params.act if isinstance(params, RoleParams) else params

    def rehearsal_params(self, params: Any) -> Any:
        """Both role sets (a single set, e.g. the warm start's, plays both roles)."""
        if isinstance(params, RoleParams):
            return role_state(params.act, params.rehearse)
        return role_state(params, params)

    def exports(self, params: Any) -> dict[str, Any]:
        """A trained REHEARSE set goes to export_rehearse/."""
        out = super().exports(params)
        if self.train_rehearser:
            out["export_rehearse"] = params.rehearse
        return out


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


def strategy(row: Mode, setup: RolloutSetup) -> SharedPolicy:
    """The strategy of mode-table row `row` (`modes.lookup(config.mode, view)`)."""
    return row.strategy_class()(row, setup)
