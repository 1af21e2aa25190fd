"""Rollouts against a real, executable environment (host turns), and rehearsal fidelity.

Committed execution: the policy decodes until an ACT message with tool calls ends; the loop
pauses that row, the host parses the calls and executes them in the row's environment, and the
observation is appended on top of the KV cache (never re-prefilling the history) as CONTEXT.
The episode is scored by the environment's own success test (final state and final reply; an
episode with a call error fails, as the checklist's semantics end it there) and by the rule
judge.

Multi-host (`layout`): each process steps the environments of its own rows only; the sampler
runs on the global batch, and the processes agree on when to resume and when every row is done.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from envace_jax import parallel
from envace_jax.envs.base import error_code, is_call_error, result_text
from envace_jax.rewards.rule_judge import judge
from envace_jax.rollout.episodes import Episode, build_episodes, response_matches
from envace_jax.rollout.world_rehearsal import (
    GroupSampling,
    RolloutBatch,
    judged_batch,
    rollout_stats,
    task_prompts,
)
from envace_jax.sampling.chat_spec import observation_ids
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.loop import Trajectories
from envace_jax.sampling.sampler import Sampler
from envace_jax.text.codes import Role, Status
from envace_jax.text.tool_calls import parse_tool_calls


@dataclasses.dataclass
class RealEpisode:
    episode: Episode
    success: bool
    reward: float
    call_errors: int  # executed calls that got an error response
    env_state: dict


def last_act_text(tokenizer, state, b: int) -> str:
    n = int(state.length[b])
    segs = np.asarray(state.segments[b, :n])
    roles = np.asarray(state.roles[b, :n])
    idx = np.flatnonzero((segs == segs.max()) & (roles == Role.ACT))
    text = tokenizer.decode(np.asarray(state.tokens[b, idx]).tolist(), skip_special_tokens=False)
    stop = "<|im_end|>"
    return text[: -len(stop)] if text.endswith(stop) else text


def real_env_rollouts(
    sampler: Sampler,
    tokenizer,
    tasks: Sequence[Any],
    make_env: Callable[[], Any],
    *,
    key: jax.Array,
    sampling: SamplingParams,
    max_new_tokens: int,
    prompts: Sequence[Sequence[int]] | None = None,
    layout: parallel.RowLayout | None = None,
    prefilled=None,
) -> tuple[list[RealEpisode], Trajectories]:
    """One committed execution of every task in a fresh environment (sampler mode 'host'): the
    episodes, and the sampled rows (observations are CONTEXT) for training.

    prompts: optional prompt ids per task (e.g. with a rehearsal memory in the context);
    default: the task's opening messages.
    layout: the global batch's rows; `tasks` (and `prompts`) are then this process's rows
    (`layout.rows`), and every process must call this together.
    prefilled: `prefill_tasks`' state for these tasks and prompts, decoded instead of a new
    prefill (the sampled runs of one evaluation share it)."""
    if sampler.spec.mode != "host":
        raise ValueError("real_env_rollouts needs a sampler whose TurnSpec.mode is 'host'")
    envs = [make_env() for _ in tasks]
    for env, task in zip(envs, tasks, strict=True):
        env.reset(task)
    observations: list[list[list[str]]] = [[] for _ in tasks]
    call_errors = [0] * len(tasks)
    invalid_calls = [False] * len(tasks)
    if prefilled is None:
        prefilled = prefill_tasks(sampler, tokenizer, tasks, max_new_tokens, prompts, layout)
    state = sampler.start(key=key, sampling=sampling, layout=layout, prefilled=prefilled)
    while True:
        rows = _host_rows(state, layout)
        waiting = np.flatnonzero(np.asarray(rows.status) == Status.AWAITING_ENV)
        if not _anywhere(len(waiting) > 0, layout):
            break
        obs: list[list[int] | None] = [None] * len(tasks)
        invalid = []
        for b in waiting:
            action = parse_tool_calls(last_act_text(tokenizer, rows, b), tasks[b].tools)
            if action.error is not None or not action.calls:
                invalid.append(b)
                continue
            results = envs[b].step(action.calls)
            call_errors[b] += sum(error_code(r) is not None for r in results)
            invalid_calls[b] |= any(is_call_error(r) for r in results)
            texts = [result_text(r) for r in results]
            observations[b].append(texts)
            obs[b] = observation_ids(tokenizer, texts)
        if _anywhere(bool(invalid), layout):
            status = np.asarray(rows.status).copy()
            status[invalid] = Status.INVALID
            state = sampler.set_status(state, status, layout)
        if _anywhere(any(o is not None for o in obs), layout):
            state = sampler.resume(state, obs, sampling=sampling, layout=layout)
    out = sampler.trajectories(state, layout)
    return _judged(tokenizer, tasks, out, envs, observations, call_errors, invalid_calls), out


def prefill_tasks(
    sampler: Sampler,
    tokenizer,
    tasks: Sequence[Any],
    max_new_tokens: int,
    prompts: Sequence[Sequence[int]] | None = None,
    layout: parallel.RowLayout | None = None,
):
    """The sampler state with the tasks' prompts prefilled (`real_env_rollouts`' arguments)."""
    default_prompts, users = task_prompts(tokenizer, tasks)
    return sampler.prefill(
        list(prompts or default_prompts),
        max_new_tokens=max_new_tokens,
        user_turns=users,
        layout=layout,
    )


def _judged(tokenizer, tasks, out, envs, observations, call_errors, invalid_calls):
    """Each row's `RealEpisode`: its success in its environment and its checklist score."""
    results = []
    episodes = build_episodes(tokenizer, tasks, out, observations)
    for b, (task, ep) in enumerate(zip(tasks, episodes, strict=True)):
        # A call error (unknown tool, arguments off the schema) fails the episode, as the
        # checklist's semantics end it there; domain errors (not_found, ...) do not.
        ok = ep.status != Status.INVALID and ep.final_reply is not None and not invalid_calls[b]
        success = bool(ok and envs[b].success(ep.final_reply, ep.messages))
        results.append(
            RealEpisode(
                ep, success, judge(task, ep.messages).score, call_errors[b], envs[b].state()
            )
        )
    return results


def _host_rows(state, layout: parallel.RowLayout | None):
    """The loop state's fields the host reads, for this process's rows."""
    if layout is None:
        return state
    fields = ("tokens", "roles", "segments", "length", "status")
    return types.SimpleNamespace(**{k: layout.to_local(getattr(state, k)) for k in fields})


def _anywhere(flag: bool, layout: parallel.RowLayout | None) -> bool:
    """`flag` on any process: they all call the sampler together or not at all."""
    return bool(flag) if layout is None else parallel.process_max(int(bool(flag))) > 0


def real_env_metrics(results: Sequence[RealEpisode], everywhere: bool = False) -> dict[str, float]:
    """Success, reward, tool-error rate, invalid rate and calls per episode (over every process's
    episodes when `everywhere`: a collective)."""
    calls = sum(len(r.episode.calls) for r in results)
    sums = np.asarray(
        [
            len(results),
            sum(r.success for r in results),
            sum(r.reward for r in results),
            sum(r.call_errors for r in results),
            calls,
            sum(r.episode.status == Status.INVALID for r in results),
        ],
        float,
    )
    if everywhere:
        sums = parallel.process_sum(sums)
    n, success, reward, errors, calls, invalid = sums
    return {
        "success": float(success / max(n, 1)),
        "reward": float(reward / max(n, 1)),
        "tool_error_rate": float(errors / max(calls, 1)),
        "invalid_rate": float(invalid / max(n, 1)),
        "calls_mean": float(calls / max(n, 1)),
    }


def rehearsal_fidelity(
    episodes: Sequence[Episode], tasks: Sequence[Any], make_env: Callable[[], Any]
) -> tuple[float, int]:
    """Fraction of rehearsed responses equal to what the real environment returns for the same
    calls (replayed in order in a fresh environment), and how many responses were compared."""
    matches = total = 0
    for ep, task in zip(episodes, tasks, strict=True):
        if not ep.rehearsed:
            continue
        env = make_env()
        env.reset(task)
        real = []
        for name, args in ep.calls:
            real += env.step([{"name": name, "arguments": args}])
        for call_index, text in ep.rehearsed:
            total += 1
            matches += call_index < len(real) and response_matches(text, real[call_index])
    return (matches / total if total else 0.0), total


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
