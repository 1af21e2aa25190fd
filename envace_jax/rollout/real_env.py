"""Rollouts against a real, executable environment (host turns), and rehearsal fidelity.

Committed execution: the policy decodes until an ACT message with tool calls ends; the loop
pauses that row, the host parses the calls and executes them in the row's environment, and the
observation is appended on top of the KV cache (never re-prefilling the history) as CONTEXT.
The episode is scored by the environment's own success test (final state and final reply) and
by the rule judge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from envace_jax.envs.base import error_code, result_text
from envace_jax.rewards.rule_judge import judge
from envace_jax.rl.batch import STATUS_INVALID
from envace_jax.rollout.episodes import Episode, build_episode, response_matches
from envace_jax.rollout.world_rehearsal import task_prompts
from envace_jax.sampling.chat_spec import observation_ids
from envace_jax.sampling.distributions import SamplingParams
from envace_jax.sampling.loop import Status, Trajectories, to_trajectories
from envace_jax.sampling.sampler import Sampler
from envace_jax.text.tool_calls import parse_tool_calls
from envace_jax.text.trajectory import Role


@dataclasses.dataclass
class RealEpisode:
    episode: Episode
    success: bool
    reward: float
    call_errors: int  # executed calls that got an error response
    env_state: dict


def _last_act_text(tokenizer, state, b: int) -> str:
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
) -> list[RealEpisode]:
    """One committed execution of every task in a fresh environment (sampler mode 'host').

    prompts: optional prompt ids per task (e.g. with a rehearsal memory in the context);
    default: the task's opening messages."""
    return real_env_trajectories(
        sampler,
        tokenizer,
        tasks,
        make_env,
        key=key,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        prompts=prompts,
    )[0]


def real_env_trajectories(
    sampler: Sampler,
    tokenizer,
    tasks: Sequence[Any],
    make_env: Callable[[], Any],
    *,
    key: jax.Array,
    sampling: SamplingParams,
    max_new_tokens: int,
    prompts: Sequence[Sequence[int]] | None = None,
) -> tuple[list[RealEpisode], Trajectories]:
    """`real_env_rollouts`, and the sampled rows (observations are CONTEXT), for training."""
    if sampler.spec.mode != "host":
        raise ValueError("real_env_rollouts needs a sampler whose TurnSpec.mode is 'host'")
    default_prompts, users = task_prompts(tokenizer, tasks)
    envs = [make_env() for _ in tasks]
    for env, task in zip(envs, tasks, strict=True):
        env.reset(task)
    observations: list[list[list[str]]] = [[] for _ in tasks]
    call_errors = [0] * len(tasks)
    state = sampler.start(
        list(prompts or default_prompts),
        key=key,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        user_turns=users,
    )
    while True:
        waiting = np.flatnonzero(np.asarray(state.status) == Status.AWAITING_ENV)
        if len(waiting) == 0:
            break
        obs: list[list[int] | None] = [None] * len(tasks)
        invalid = []
        for b in waiting:
            action = parse_tool_calls(_last_act_text(tokenizer, state, b), tasks[b].tools)
            if action.error is not None or not action.calls:
                invalid.append(b)
                continue
            results = envs[b].step(action.calls)
            call_errors[b] += sum(error_code(r) is not None for r in results)
            texts = [result_text(r) for r in results]
            observations[b].append(texts)
            obs[b] = observation_ids(tokenizer, texts)
        if invalid:
            state = state.replace(status=state.status.at[jnp.asarray(invalid)].set(Status.INVALID))
        if any(o is not None for o in obs):
            state = sampler.resume(state, obs, sampling=sampling)
    out = to_trajectories(state, tokenizer.pad_token_id)
    results = []
    for b, task in enumerate(tasks):
        ep = build_episode(
            tokenizer,
            task,
            out.tokens[b],
            out.roles[b],
            out.segments[b],
            int(out.lengths[b]),
            int(out.status[b]),
            observations=observations[b],
        )
        ok = ep.status != STATUS_INVALID and ep.final_reply is not None
        success = bool(ok and envs[b].success(ep.final_reply))
        results.append(
            RealEpisode(
                ep, success, judge(task, ep.messages).score, call_errors[b], envs[b].state()
            )
        )
    return results, out


def real_env_metrics(results: Sequence[RealEpisode]) -> dict[str, float]:
    calls = sum(len(r.episode.calls) for r in results)
    return {
        "success": float(np.mean([r.success for r in results])),
        "reward": float(np.mean([r.reward for r in results])),
        "tool_error_rate": sum(r.call_errors for r in results) / max(calls, 1),
        "invalid_rate": float(np.mean([r.episode.status == STATUS_INVALID for r in results])),
        "calls_mean": calls / max(len(results), 1),
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
