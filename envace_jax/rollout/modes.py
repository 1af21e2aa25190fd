"""Training modes: what produces the RL phase's judged batch, and who plays each role.

Every mode runs through the same trainer loop (warm start -> RL steps -> real-environment
evaluation) with the same budget; they differ only in the rollouts of an RL step and in which
parameters are trained on which tokens:

======================  =====================  ============================  ===================
mode                    trajectories           REHEARSE (environment) by     trained
======================  =====================  ============================  ===================
`envace`                world rehearsal        the policy (shared params)    ACT + REHEARSE
`envace_noshare`        world rehearsal        a second parameter set        each set its role
`external_simulator`    world rehearsal        frozen copy of the warm start ACT only
`grpo_real_env`         host turns, real env   the real environment          ACT only
`corrupted_world`       host turns, simulator  a corrupted copy of the world ACT only
`sft_only`              none (no RL steps)     -                             -
======================  =====================  ============================  ===================

`envace_noshare` is the reference's noshare ablation: two parameter sets, both starting from
the warm start, each with its own optimizer and trained only on its role's tokens.
`external_simulator` is its caller-only / Simulator baseline: the environment is simulated by a
model that never learns from the task reward. In both, sampling runs one compiled loop over
`role_models.RoleDecoders`. `grpo_real_env` is standard GRPO with the executable environment in
the loop: the real observations are CONTEXT tokens, and the reward is the same rule judge as in
world rehearsal, applied to the real trajectory (its tool results come from the real world
state, and a call error zeroes the turn), so the modes differ only in where observations come
from. `corrupted_world` is the same GRPO against a deliberately wrong copy of the world
(`rollout.corruption`, the domain's `corrupted_envs`): the control that shows how much worse a
policy trained on wrong responses acts. It calls no environment (its calls are simulator calls).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from envace_jax.rollout.real_env import real_env_rollouts
from envace_jax.rollout.world_rehearsal import (
    GroupSampling,
    RolloutBatch,
    judged_batch,
    rollout_stats,
)
from envace_jax.sampling.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """How one training mode gets its RL batch.

    rollout: 'rehearsal' (world rehearsal, no environment), 'real_env' (host turns), 'simulator'
      (host turns against a corrupted copy of the world) or 'none'.
    rehearser: who writes REHEARSE tokens: 'policy' (the trained params), 'separate' (a second
      trained parameter set), 'frozen' (the warm start, never trained) or 'none'.
    """

    name: str
    rollout: str
    rehearser: str
    summary: str

    @property
    def role_params(self) -> bool:
        """Whether ACT and REHEARSE have their own parameter sets."""
        return self.rehearser in ("separate", "frozen")


MODE_SPECS = {
    m.name: m
    for m in (
        ModeSpec("envace", "rehearsal", "policy", "world rehearsal, shared parameters"),
        ModeSpec("envace_noshare", "rehearsal", "separate", "world rehearsal, a policy per role"),
        ModeSpec("grpo_real_env", "real_env", "none", "GRPO in the real environment"),
        ModeSpec("external_simulator", "rehearsal", "frozen", "GRPO, frozen model as environment"),
        ModeSpec("corrupted_world", "simulator", "none", "GRPO in a corrupted copy of the world"),
        ModeSpec("sft_only", "none", "none", "the warm start, no RL"),
    )
}


def mode_spec(name: str) -> ModeSpec:
    if name not in MODE_SPECS:
        raise ValueError(f"config.mode = {name!r}: expected one of {tuple(MODE_SPECS)}")
    return MODE_SPECS[name]


def real_env_group_rollouts(
    sampler: Sampler,
    tokenizer,
    tasks: Sequence[Any],
    make_env: Callable[[], Any],
    group: GroupSampling,
) -> RolloutBatch:
    """`group.group_size` real-environment episodes of every task (each in a fresh
    environment), judged on the real trajectory, as a training batch; rows of task i have
    group i.

    The observations are CONTEXT tokens (never trained). Stats add the real success rate and
    the real tool-error rate to `rollout_stats`'."""
    if sampler.spec.mode != "host":
        raise ValueError("real_env_group_rollouts needs a sampler whose TurnSpec.mode is 'host'")
    rows = [t for t in tasks for _ in range(group.group_size)]
    results, out = real_env_rollouts(
        sampler,
        tokenizer,
        rows,
        make_env,
        key=group.key,
        sampling=group.sampling,
        max_new_tokens=group.max_new_tokens,
    )
    episodes = [r.episode for r in results]
    rewards = np.asarray([r.reward for r in results], np.float64)
    group_ids = np.repeat(np.arange(len(tasks)), group.group_size)
    batch = judged_batch(
        tokenizer,
        out,
        episodes,
        rewards,
        group_ids,
        group.length_buckets,
        batch_size=group.batch_size,
    )
    lengths = np.asarray([ep.end for ep in episodes], np.int32)
    stats = rollout_stats(episodes, rewards, lengths)
    calls = sum(len(ep.calls) for ep in episodes)
    stats["real_success"] = float(np.mean([r.success for r in results]))
    stats["real_tool_error_rate"] = sum(r.call_errors for r in results) / max(calls, 1)
    return RolloutBatch(batch, episodes, rows, stats)
