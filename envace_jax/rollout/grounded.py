"""Grounded world rehearsal: the policy answers each tool call from a simulator prompt of its own.

This is the reference's Tool Simulator view (the design's "grounded" view). The policy acts in
its own sequence; when an ACT message ends with tool calls, the same policy writes the tools'
responses in a second chat, whose prompt holds:

* simulator instructions and the task's tools;
* the task's logged (call, response) pairs, read from the task record's reference conversation
  (logged data, never the live environment);
* the calls and responses of this episode so far, and the current calls.

The rehearsed responses go back into the ACT sequence as CONTEXT, as real observations would,
so no ACT token ever attends to the logged pairs. Each simulator answer trains as a row of its
own: the REHEARSE role, the episode's reward, the episode's task group.

A simulator answer has one line per call, `call -> response` as in the logged block, so that
writing the call first puts the matching logged line's response one copy away. An answer that
does not parse ends the episode as INVALID with a `bad_observation` error, as in the shared
view.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from envace_jax.envs.base import (
    BAD_OBSERVATION,
    error_code,
    parse_result_text,
    result_text,
    tool_error,
)
from envace_jax.rl.batch import TrajectoryBatch, from_numpy, pad_to_bucket, smallest_fitting_bucket
from envace_jax.rollout.episodes import build_episodes
from envace_jax.rollout.real_env import last_act_text
from envace_jax.rollout.world_rehearsal import (
    GroupSampling,
    RolloutBatch,
    judge_episodes,
    judged_batch,
    rollout_stats,
    task_prompts,
)
from envace_jax.sampling.chat_spec import observation_ids
from envace_jax.sampling.sampler import Sampler, pow2_bucket
from envace_jax.text.chat import messages_from_text
from envace_jax.text.codes import Role, Status
from envace_jax.text.role_pieces import prompt_ids
from envace_jax.text.tool_calls import parse_tool_calls
from envace_jax.text.trajectory import EncodedConversation, encode_conversation

SIMULATOR_SYSTEM = (
    "You are the tools. Answer each call with the tool's JSON response, one line per call. "
    "The logged calls show how the tools answer in this task."
)
ARROW = " -> "  # between a call and its response, in the prompt and in the answer


def call_line(name: str, arguments: Any) -> str:
    """One call as the simulator reads it: `name {json arguments}` (keys sorted)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return f"{name} {json.dumps(arguments, sort_keys=True)}"


def _tool_calls(message: dict) -> list[str]:
    return [
        call_line(c["function"]["name"], c["function"].get("arguments", {}))
        for c in message.get("tool_calls") or []
    ]


def call_pairs(messages: Sequence[dict]) -> list[tuple[list[str], list[str]]]:
    """(calls, responses) of every assistant message with tool calls, in order."""
    turns: list[tuple[list[str], list[str]]] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            turns.append((_tool_calls(m), []))
        elif m.get("role") == "tool" and turns:
            turns[-1][1].append(m.get("content") or "")
    return turns


def logged_pairs(task: Any) -> list[tuple[str, str]]:
    """The task record's logged (call, response) pairs: its reference conversation's."""
    return [
        p
        for calls, resps in call_pairs(task.reference_messages)
        for p in zip(calls, resps, strict=False)
    ]


def _tool_signature(tool: dict) -> str:
    fn = tool.get("function", tool)
    params = fn.get("parameters", {}).get("properties", {})
    return f"{fn.get('name')}({', '.join(params)})"


def simulator_messages(
    task: Any, history: Sequence[tuple[str, str]], calls: Sequence[str]
) -> list[dict]:
    """The simulator's chat for `calls` (call lines) after this episode's `history` pairs."""

    def lines(pairs):
        return "".join(f"{c}{ARROW}{r}\n" for c, r in pairs)

    tools = "".join(f"{_tool_signature(t)}\n" for t in task.tools)
    user = f"logged:\n{lines(logged_pairs(task))}history:\n{lines(history)}call:\n" + "\n".join(
        calls
    )
    return [
        {"role": "system", "content": f"{SIMULATOR_SYSTEM}\ntools:\n{tools}".rstrip()},
        {"role": "user", "content": user},
    ]


def answer_text(calls: Sequence[str], responses: Sequence[str]) -> str:
    """A simulator answer: one `call -> response` line per call."""
    return "\n".join(f"{c}{ARROW}{r}" for c, r in zip(calls, responses, strict=True))


def simulated_responses(text: str, num_calls: int) -> tuple[list[str], str | None]:
    """The responses of a simulator answer, or ([], the problem) if it does not parse."""
    lines = text.strip().split("\n") if text.strip() else []
    if len(lines) != num_calls:
        return [], f"{len(lines)} response lines for {num_calls} calls"
    responses = []
    for line in lines:
        _, arrow, response = line.partition(ARROW)
        if not arrow or error_code(parse_result_text(response)) == BAD_OBSERVATION:
            return [], f"not a 'call -> JSON object' line: {line[:60]!r}"
        responses.append(response)
    return responses, None


def simulator_demonstrations(
    tokenizer, tasks: Sequence[Any], demos: Sequence[EncodedConversation]
) -> list[EncodedConversation]:
    """The warm start's simulator rows: for every tool turn of every demonstration, the
    simulator prompt and the environment's real responses as the REHEARSE target."""
    rows = []
    for task, demo in zip(tasks, demos, strict=True):
        history: list[tuple[str, str]] = []
        for calls, responses in call_pairs(messages_from_text(tokenizer, demo.ids.tolist())):
            if len(responses) != len(calls):
                continue
            rows.append(simulator_row(tokenizer, task, history, calls, responses))
            history += list(zip(calls, responses, strict=True))
    return rows


def simulator_row(tokenizer, task, history, calls, responses) -> EncodedConversation:
    """One simulator prompt and its answer, the answer tagged REHEARSE."""
    messages = simulator_messages(task, history, calls)
    messages.append({"role": "assistant", "content": answer_text(calls, responses)})
    enc = encode_conversation(tokenizer, messages)
    roles = np.where(enc.roles == Role.ACT, int(Role.REHEARSE), enc.roles).astype(np.int8)
    return EncodedConversation(enc.ids, roles, enc.segments)


class _Answers:
    """The simulator rows of one rollout batch: each sampled row cut after its answer (the
    simulator's first message), with the answer's mask and log-probs, and the episode it
    answered for."""

    def __init__(self):
        self.rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # tokens, answer, logp
        self.owner: list[int] = []

    def add(self, tokenizer, out, i: int, owner: int) -> str:
        """Keeps row `i` of the simulator's output `out`, answering for episode `owner`; returns
        the answer's text."""
        n = int(out.lengths[i])
        answer = (np.asarray(out.segments[i, :n]) == 1) & (np.asarray(out.roles[i, :n]) == Role.ACT)
        end = int(np.flatnonzero(answer).max(initial=-1)) + 1
        logp = np.where(answer, np.asarray(out.logprobs[i, :n]), 0.0)
        tokens = np.asarray(out.tokens[i, :end])
        self.rows.append((tokens, answer[:end], logp[:end]))
        self.owner.append(owner)
        return tokenizer.decode(tokens[answer[:end]].tolist(), skip_special_tokens=True)

    def batch(self, pad_id, rewards, groups, rows: int, key, length_buckets) -> TrajectoryBatch:
        """`rows` rows: a seeded subsample of the answers, or all of them and padding rows."""
        order = np.arange(len(self.rows))
        if len(order) > rows:
            order = np.sort(np.asarray(jax.random.permutation(key, len(order))[:rows]))
        T = max((len(self.rows[i][0]) for i in order), default=1)
        tokens = np.full((len(order), T), pad_id, np.int32)
        answers = np.zeros((len(order), T), bool)
        logprobs = np.zeros((len(order), T), np.float32)
        for j, i in enumerate(order):
            t, a, lp = self.rows[i]
            tokens[j, : len(t)], answers[j, : len(t)], logprobs[j, : len(t)] = t, a, lp
        owners = np.asarray([self.owner[i] for i in order], np.int64)
        batch = from_numpy(
            tokens=tokens,
            roles=np.where(answers, int(Role.REHEARSE), int(Role.CONTEXT)),
            segments=answers.astype(np.int32),
            logprobs=logprobs,
            lengths=[len(self.rows[i][0]) for i in order],
            group=groups[owners],
            reward=rewards[owners],
        )
        bucket = smallest_fitting_bucket(T, length_buckets)
        return pad_to_bucket(batch, (bucket,), batch_size=rows, pad_id=pad_id)


class _Episodes:
    """What the host keeps of each grounded episode while it runs: its (call, response) history,
    its observations, and why its last simulator answer did not parse, if it did not."""

    def __init__(self, rows: Sequence[Any]):
        self.rows = rows
        self.history: list[list[tuple[str, str]]] = [[] for _ in rows]
        self.observations: list[list[list[str]]] = [[] for _ in rows]
        self.broken: dict[int, str] = {}

    def answer(
        self,
        sampler,
        tokenizer,
        state,
        waiting,
        answers: _Answers,
        key,
        sampling,
        max_message_tokens,
    ) -> list[list[int] | None]:
        """The simulator's observation ids for each row of `waiting` (None where the action or
        the answer does not parse); every answer is kept in `answers`."""
        calls: dict[int, list[str]] = {}
        for b in waiting:
            action = parse_tool_calls(last_act_text(tokenizer, state, b), self.rows[b].tools)
            if action.error is None and action.calls:
                calls[b] = [call_line(c.name, c.arguments) for c in action.calls]
        asked = sorted(calls)
        obs: list[list[int] | None] = [None] * len(self.rows)
        if not asked:
            return obs
        chats = [simulator_messages(self.rows[b], self.history[b], calls[b]) for b in asked]
        out = _answer(sampler, tokenizer, chats, key, sampling, max_message_tokens)
        for i, b in enumerate(asked):
            responses, problem = simulated_responses(
                answers.add(tokenizer, out, i, b), len(calls[b])
            )
            if problem is not None:
                self.broken[b] = problem
                continue
            self.history[b] += list(zip(calls[b], responses, strict=True))
            self.observations[b].append(responses)
            obs[b] = observation_ids(tokenizer, responses)
        return obs

    def built(self, tokenizer, out) -> list:
        """The finished episodes, each with its rehearsed responses; an episode that a
        simulator answer ended carries that answer's error as its last tool message."""
        episodes = build_episodes(tokenizer, self.rows, out, self.observations)
        for b, ep in enumerate(episodes):
            ep.rehearsed = [(i, r) for i, (_, r) in enumerate(self.history[b])]
            if b in self.broken and ep.status == Status.INVALID:
                error = result_text(tool_error(BAD_OBSERVATION, self.broken[b]))
                ep.messages.append({"role": "tool", "content": error})
                ep.invalid_reason = f"rehearsal: {self.broken[b]}"
        return episodes


def grounded_rollouts(
    sampler: Sampler,
    tokenizer,
    tasks: Sequence[Any],
    group: GroupSampling,
    *,
    max_message_tokens: int,
    simulator_rows: int | None = None,
    judge=None,
) -> RolloutBatch:
    """`group.group_size` grounded-rehearsal episodes of every task, judged, as one training
    batch: the ACT rows (task-major, rehearsed responses as CONTEXT), then `simulator_rows`
    REHEARSE rows (default: as many as ACT rows; a seeded subsample of the answers when there
    are more, padding rows when fewer), each in its episode's task group.

    `sampler` is a host-turn sampler holding the policy; no environment is called. `judge`
    scores the episodes (`rewards.judges`; None: the rule judge)."""
    if sampler.spec.mode != "host":
        raise ValueError("grounded_rollouts needs a sampler whose TurnSpec.mode is 'host'")
    rows = [t for t in tasks for _ in range(group.group_size)]
    prompts, users = task_prompts(tokenizer, rows)
    key_act, key_sim, key_rows = jax.random.split(group.key, 3)
    state = sampler.start(
        prompts,
        key=key_act,
        sampling=group.sampling,
        max_new_tokens=group.max_new_tokens,
        user_turns=users,
    )
    host = _Episodes(rows)
    answers = _Answers()
    for round_ in range(sampler.spec.max_turns + 1):
        status = np.asarray(state.status)
        waiting = np.flatnonzero(status == Status.AWAITING_ENV)
        if not len(waiting):
            break
        key = jax.random.fold_in(key_sim, round_)
        obs = host.answer(
            sampler, tokenizer, state, waiting, answers, key, group.sampling, max_message_tokens
        )
        stop = [b for b in waiting if obs[b] is None]
        if stop:
            status = status.copy()
            status[stop] = Status.INVALID
            state = sampler.set_status(state, status)
        if any(o is not None for o in obs):
            state = sampler.resume(state, obs, sampling=group.sampling)
    out = sampler.trajectories(state)
    episodes = host.built(tokenizer, out)
    judged = judge_episodes(judge, rows, episodes)
    rewards = judged.rewards
    group_ids = np.repeat(np.arange(len(tasks)), group.group_size)
    act = judged_batch(tokenizer, out, episodes, rewards, group_ids, group.length_buckets)
    sim = answers.batch(
        tokenizer.pad_token_id,
        rewards,
        group_ids,
        simulator_rows or len(rows),
        key_rows,
        group.length_buckets,
    )
    lengths = np.asarray([ep.end for ep in episodes], np.int32)
    stats = {**rollout_stats(episodes, rewards, lengths), **judged.stats}
    stats["simulator_answers"] = float(len(answers.rows))
    return RolloutBatch(_stack(act, sim, tokenizer.pad_token_id), episodes, rows, stats)


def _answer(sampler, tokenizer, chats, key, sampling, max_message_tokens):
    """The simulator's answers to `chats`, decoded together (rows padded to a power of two)."""
    prompts = [prompt_ids(tokenizer, c) for c in chats]
    padded = prompts + [prompts[0]] * (pow2_bucket(len(prompts), minimum=8) - len(prompts))
    return sampler.generate(padded, key=key, sampling=sampling, max_new_tokens=max_message_tokens)


def _stack(a: TrajectoryBatch, b: TrajectoryBatch, pad_id: int) -> TrajectoryBatch:
    """Rows of `a` then rows of `b`, padded to the longer of their lengths."""
    T = max(a.shape[1], b.shape[1])
    a, b = (pad_to_bucket(x, (T,), pad_id=pad_id) for x in (a, b))
    return TrajectoryBatch(
        **{k: np.concatenate([getattr(a, k), getattr(b, k)]) for k in a.__dataclass_fields__}
    )
