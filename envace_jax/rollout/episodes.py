"""Sampled token rows -> chat episodes that judges and environments read.

A row of the sampler's output is one trajectory. Its generated messages are found by segment id
(the loop numbers them in order), so nothing here re-parses the prompt or the glue:

* an ACT segment is an assistant message: its text up to the stop id is parsed into tool calls
  (`text.tool_calls.parse_tool_calls` against the task's tools). No `<tool_call>` block makes it
  a final reply. An unparseable action ends the episode as INVALID, and a `bad_call` tool error
  is recorded in its place, which the checklist semantics score as a call error (turn zeroed);
* a REHEARSE segment is the tool-response turn of the preceding ACT message, split into one
  response per call; a response that is not a JSON object, or a count that does not match the
  calls, becomes a `bad_observation` error (same semantics);
* a final reply followed by more ACT segments means the loop replayed the task's next user turn,
  whose text is taken from the task's reference conversation.

Model outputs never raise here: every defect becomes a status and an error response.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from envace_jax.envs.base import (
    BAD_CALL,
    BAD_OBSERVATION,
    error_code,
    parse_result_text,
    result_text,
    tool_error,
)
from envace_jax.text.codes import Role, Status
from envace_jax.text.tool_calls import parse_tool_calls, parse_tool_responses


@dataclasses.dataclass
class Episode:
    """One trajectory as chat messages (task's opening messages included).

    status: a `Status.stopped()` code. final_reply: the text of the last ACT message when
    it was a final reply, else None. calls: the tool calls in order, as (name, arguments).
    rehearsed: (call, response text) pairs of rehearsed observations, for fidelity checks.
    """

    messages: list[dict[str, Any]]
    status: int
    final_reply: str | None = None
    calls: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    rehearsed: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    invalid_reason: str | None = None
    end: int = 0  # tokens of the row that belong to the episode (an invalid message ends it)


def _segment_spans(roles: np.ndarray, segments: np.ndarray, n: int) -> list[tuple[int, int, int]]:
    """(role, start, end) per generated segment of a row, in order."""
    spans = []
    seg = segments[:n]
    for s in range(1, int(seg.max(initial=0)) + 1):
        idx = np.flatnonzero(seg == s)
        if len(idx):
            spans.append((int(roles[idx[0]]), int(idx[0]), int(idx[-1]) + 1))
    return spans


def _strip_stop(text: str, stop_text: str) -> tuple[str, bool]:
    if text.endswith(stop_text):
        return text[: -len(stop_text)], True
    return text, False


def build_episode(
    tokenizer,
    task: Any,
    tokens: np.ndarray,
    roles: np.ndarray,
    segments: np.ndarray,
    length: int,
    sampler_status: int,
    observations: Sequence[Sequence[str]] | None = None,
) -> Episode:
    """The episode of one sampled row (see the module docstring).

    observations: for host-turn rows (real environment), the response texts the environment
    returned after each ACT message with calls, in order; those turns are CONTEXT in the row.
    """
    observations = list(observations or [])
    stop_text = tokenizer.decode([tokenizer.convert_tokens_to_ids("<|im_end|>")])
    messages = [dict(m) for m in task.messages]
    later_users = [m for m in task.reference_messages if m.get("role") == "user"][1:]
    ep = Episode(messages=messages, status=Status(sampler_status).settled(), end=length)
    pending_calls: list[Any] = []
    after_final = False
    for role, start, end in _segment_spans(roles, segments, length):
        text = tokenizer.decode(tokens[start:end].tolist(), skip_special_tokens=False)
        if role == Role.ACT:
            if after_final:  # the loop replayed the next user turn before this message
                if not later_users:
                    break
                messages.append({"role": "user", "content": later_users.pop(0).get("content")})
                after_final = False
            body, closed = _strip_stop(text, stop_text)
            action = parse_tool_calls(body, task.tools)
            if action.error is not None:
                messages.append({"role": "assistant", "content": body})
                messages.append(
                    {
                        "role": "tool",
                        "content": result_text(tool_error(BAD_CALL, action.error.code.value)),
                    }
                )
                ep.status, ep.invalid_reason = Status.INVALID, f"action: {action.error.code}"
                ep.end = end
                return ep
            if action.calls:
                pending_calls = list(action.calls)
                calls = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in action.calls
                ]
                messages.append(
                    {"role": "assistant", "content": action.content, "tool_calls": calls}
                )
                ep.calls += [(c.name, c.arguments) for c in action.calls]
                if observations:  # host turns: the environment answered these calls
                    messages += [{"role": "tool", "content": o} for o in observations.pop(0)]
                    pending_calls = []
            else:
                messages.append({"role": "assistant", "content": body})
                if closed:
                    ep.final_reply, after_final = body, True
        elif role == Role.REHEARSE:
            responses, problem = parse_tool_responses(text, num_calls=len(pending_calls))
            if problem is None:
                bad = [r for r in responses if error_code(parse_result_text(r)) == BAD_OBSERVATION]
                problem = f"response is not a JSON object: {bad[0][:60]!r}" if bad else None
            if problem is not None:
                error = result_text(tool_error(BAD_OBSERVATION, problem))
                messages += [{"role": "tool", "content": error}] * max(1, len(pending_calls))
                ep.status, ep.invalid_reason = Status.INVALID, f"rehearsal: {problem}"
                ep.end = end
                return ep
            first_call = len(ep.calls) - len(pending_calls)
            for i, response in enumerate(responses):
                messages.append({"role": "tool", "content": response})
                ep.rehearsed.append((first_call + i, response))
            pending_calls = []
    return ep


def build_episodes(
    tokenizer,
    tasks: Sequence[Any],
    out,
    observations: Sequence[Sequence[Sequence[str]]] | None = None,
) -> list[Episode]:
    """Episodes of every row of a `sampling.loop.Trajectories`; row b belongs to tasks[b] (and,
    for host-turn rows, got the responses `observations[b]`)."""
    return [
        build_episode(
            tokenizer,
            tasks[b],
            out.tokens[b],
            out.roles[b],
            out.segments[b],
            int(out.lengths[b]),
            int(out.status[b]),
            observations=list(observations[b]) if observations is not None else None,
        )
        for b in range(len(tasks))
    ]


def response_matches(rehearsed: str, real: Mapping[str, Any]) -> bool:
    """A rehearsed response equals the real one when both parse to the same JSON value."""
    try:
        return json.loads(rehearsed) == json.loads(json.dumps(real))
    except ValueError:
        return False
