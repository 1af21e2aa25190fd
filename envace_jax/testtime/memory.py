"""Rehearsal memory: what private rehearsals of a task leave for its one committed execution.

A rehearsal attempt (`Attempt`) is a world-rehearsal trajectory of the task: the policy's tool
calls, the responses it *expected* (rehearsed, never executed), and its final reply. After
each attempt comes an `Assessment`: the problems found in it and a revision suggestion. The
rule assessor here (`assess`) reads only what the agent itself has at test time (the task's
opening messages, its tool list and the attempt), never the task's ground truth:

* the attempt did not finish (unparseable message, token or turn limit, no final reply);
* a rehearsed response is an error (the world, as the policy models it, refused the call);
* an argument value is *ungrounded*: it appears neither in a user message nor in an earlier
  rehearsed response (ids are to be taken from tool results);
* a number in the final reply is ungrounded in the same sense.

Memory formats. The memory fills the prompt's memory slot (`text.memory_slot`: a fixed place
that holds "Rehearsal memory: none" when there is no memory); without a slot it is appended to
the task's instruction.

* ``structured`` (small models that cannot write summaries): the attempts are reduced to one
  selected plan (`select_plan`: fewest problems first, then the plan most attempts share, then
  the earliest) as exact call lines, and the calls the rehearsals expect to be refused, each
  with the refusal it met::

      Rehearsal memory (from private rehearsals, not real):
      plan (3 of 4 rehearsals):
      1. find_customer {"name": "Eli"}
      2. cancel_order {"order_id": "O3"}
      avoid:
      - refund {"order_id": "O3"} -> bad_status

  Arguments are compact JSON, as in tool calls. The rehearsed response bodies are left out:
  they are a rehearsal's least faithful part, and the call lines are what the committed run
  copies. A plan with no calls reads ``plan (k of N rehearsals): reply without tool calls``;
  no usable attempt reads ``plan: none``. At most `MAX_NOTES` distinct avoid lines are kept,
  and a policy-written assessment (assessor 'policy') adds its text under ``notes:``.
* ``summary`` (real LLMs): the policy writes the memory itself from a summarisation prompt
  that holds every attempt's transcript (`render_transcripts`) with its assessment; the text is
  cleaned of chat-control tokens (`clean_generated`) and inserted under `SUMMARY_HEADER`.

The warm start's memory demonstrations are in `testtime.demonstrations`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envace_jax.envs.base import error_code, observed_values, parse_result_text
from envace_jax.text import memory_slot
from envace_jax.text.codes import Status
from envace_jax.text.tokenizer import SPECIAL_TOKEN_TEXTS

FORMATS = ("structured", "summary")
HEADER = "Rehearsal memory (from private rehearsals, not real):"
SUMMARY_HEADER = "Rehearsal memory (written from private rehearsals, not real):"
HISTORY_HEADER = "Earlier private rehearsals (expected results, not real):"
MAX_NOTES = 3
NO_PLAN = "plan: none"  # the memory's line when no attempt's plan is shown
MAX_RESPONSE_CHARS = 300  # a rehearsed response longer than this is cut in transcripts

_NUMBER = re.compile(r"(?<![\w.])-?\d+(?!\w|\.\d)")  # integers, not parts of ids or decimals
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f\ufffd]")


# ----------------------------------------------------------------------------- attempts


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One private rehearsal of a task.

    calls: (name, arguments) in order. responses: the rehearsed response text of each call
    (None where the attempt stopped before one). final_reply: None if it never replied.
    status: a `Status.stopped()` code; reason: why it is invalid, if it is."""

    calls: tuple[tuple[str, Any], ...]
    responses: tuple[str | None, ...]
    final_reply: str | None
    status: int
    reason: str | None = None

    @classmethod
    def from_episode(cls, episode) -> Attempt:
        """The attempt of a rehearsed `rollout.episodes.Episode`."""
        responses: list[str | None] = [None] * len(episode.calls)
        for i, text in episode.rehearsed:
            if i < len(responses):
                responses[i] = text
        return cls(
            calls=tuple((n, a) for n, a in episode.calls),
            responses=tuple(responses),
            final_reply=episode.final_reply,
            status=int(episode.status),
            reason=episode.invalid_reason,
        )

    def signature(self) -> tuple:
        """What two attempts that made the same plan share: the calls, in order."""
        return tuple((n, json.dumps(a, sort_keys=True)) for n, a in self.calls)


@dataclasses.dataclass(frozen=True)
class Assessment:
    """Problems found in an attempt (empty: none found) and a revision suggestion. `text` is a
    policy-written assessment when the policy assessed the attempt, else empty."""

    problems: tuple[str, ...] = ()
    revision: str = ""
    text: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def _args_text(arguments: Any) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def _call_text(name: str, arguments: Any) -> str:
    return f"{name} {_args_text(arguments)}"


def _user_text(task: Any) -> str:
    return "\n".join(str(m.get("content") or "") for m in task.messages if m.get("role") == "user")


def _grounded(value: Any, user_text: str, seen: Sequence[Any]) -> bool:
    if value in seen:
        return True
    text = str(value)
    return re.search(rf"(?<![\w]){re.escape(text)}(?![\w])", user_text) is not None


def assess(task: Any, attempt: Attempt, *, require_finish: bool = True) -> Assessment:
    """The rule assessment of `attempt` (see the module docstring); reads no ground truth.

    require_finish: count an unfinished attempt (no final reply) as a problem."""
    problems: list[str] = []
    revisions: list[str] = []
    if attempt.status == Status.INVALID:
        problems.append(f"invalid message ({attempt.reason or 'unparseable'})")
        revisions.append("write calls as JSON the tools accept")
    elif require_finish and (attempt.status != Status.FINISHED or attempt.final_reply is None):
        problems.append("no final reply")
        revisions.append("make the calls, then reply")
    user_text = _user_text(task)
    seen: list[Any] = []
    for (name, args), response in zip(attempt.calls, attempt.responses, strict=True):
        if isinstance(args, Mapping):
            for key, value in args.items():
                if isinstance(value, (str, int)) and not isinstance(value, bool):
                    if not _grounded(value, user_text, seen):
                        problems.append(f"{name} {key}={_args_text(value)} is from no result")
                        revisions.append("look the value up first")
        if response is None:
            continue
        result = parse_result_text(response)
        code = error_code(result)
        if code is not None:
            problems.append(f"{_call_text(name, args)} got {code}")
            revisions.append("check ids, states and amounts in the records")
        seen.extend(observed_values(result))
    if attempt.final_reply is not None:
        for number in _NUMBER.findall(attempt.final_reply):
            if not _grounded(int(number), user_text, seen):
                problems.append(f"reply states {number}, which no result gave")
                revisions.append("state the value the last result gave")
    revision = "; ".join(dict.fromkeys(revisions))  # distinct, in order
    return Assessment(tuple(problems), revision)


# ----------------------------------------------------------------------- selection, text


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen attempt (None: no usable attempt), how many attempts made the same plan, and
    how many there were."""

    index: int | None
    support: int
    total: int


def select_plan(attempts: Sequence[Attempt], assessments: Sequence[Assessment]) -> Selection:
    """Fewest problems first; among those the plan most attempts share; then the earliest.
    An attempt that is invalid before making any call is not usable."""
    usable = [
        i
        for i, a in enumerate(attempts)
        if a.calls or (a.status != Status.INVALID and a.final_reply is not None)
    ]
    if not usable:
        return Selection(None, 0, len(attempts))
    fewest = min(len(assessments[i].problems) for i in usable)
    best = [i for i in usable if len(assessments[i].problems) == fewest]
    votes: dict[tuple, int] = {}
    for a in attempts:
        votes[a.signature()] = votes.get(a.signature(), 0) + 1
    chosen = max(best, key=lambda i: (votes[attempts[i].signature()], -i))
    return Selection(chosen, votes[attempts[chosen].signature()], len(attempts))


def render_plan_lines(attempt: Attempt) -> list[str]:
    return [f"{k}. {_call_text(n, a)}" for k, (n, a) in enumerate(attempt.calls, start=1)]


def refusals(attempt: Attempt) -> list[str]:
    """`call -> error code` of every call whose (rehearsed or real) response is an error."""
    out = []
    for (name, args), response in zip(attempt.calls, attempt.responses, strict=True):
        code = None if response is None else error_code(parse_result_text(response))
        if code is not None:
            out.append(f"{_call_text(name, args)} -> {code}")
    return out


def render_memory(
    attempts: Sequence[Attempt],
    assessments: Sequence[Assessment],
    selection: Selection | None = None,
    extra_avoid: Sequence[str] = (),
    min_support: int = 1,
) -> str:
    """The structured memory of `attempts` (see the module docstring for the format);
    `extra_avoid`: further `call -> refusal` lines, after the attempts' own. When fewer than
    `min_support` attempts made the selected plan, the memory is ``plan: none`` and nothing
    else: rehearsals that disagree carry nothing the committed run can trust."""
    selection = selection or select_plan(attempts, assessments)
    if selection.index is not None and selection.support < min_support:
        return f"{HEADER}\n{NO_PLAN}"
    lines = [HEADER]
    if selection.index is None:
        lines.append(NO_PLAN)
    else:
        chosen = attempts[selection.index]
        head = f"plan ({selection.support} of {selection.total} rehearsals)"
        if chosen.calls:
            lines.append(head + ":")
            lines += render_plan_lines(chosen)
        else:
            lines.append(head + ": reply without tool calls")
    avoid = [line for a in attempts for line in refusals(a)] + list(extra_avoid)
    avoid = list(dict.fromkeys(avoid))[:MAX_NOTES]
    if avoid:
        lines.append("avoid:")
        lines += [f"- {line}" for line in avoid]
    notes = list(dict.fromkeys(s.text for s in assessments if s.text))[:MAX_NOTES]
    if notes:
        lines.append("notes:")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def render_transcripts(
    attempts: Sequence[Attempt], assessments: Sequence[Assessment], start: int = 1
) -> str:
    """Every attempt as plain text, each followed by its assessment (for policy prompts)."""
    blocks = []
    for k, (a, s) in enumerate(zip(attempts, assessments, strict=True), start=start):
        lines = [f"Rehearsal {k}:"]
        for (name, args), response in zip(a.calls, a.responses, strict=True):
            lines.append(f"call {_call_text(name, args)}")
            if response is not None:
                cut = response[:MAX_RESPONSE_CHARS] + (
                    "..." if len(response) > MAX_RESPONSE_CHARS else ""
                )
                lines.append(f"result {cut}")
        if a.final_reply is not None:
            lines.append(f"reply: {a.final_reply.strip()}")
        elif a.status == Status.INVALID:
            lines.append(f"(stopped: {a.reason or 'invalid message'})")
        else:
            lines.append("(stopped before a final reply)")
        if s.text:
            lines.append(s.text)
        else:
            lines.append("assessment: " + ("; ".join(s.problems) or "no problem found"))
            if s.revision:
                lines.append(f"revision: {s.revision}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def clean_generated(text: str, max_chars: int = 2000) -> str:
    """Policy-written text made safe to insert into a chat turn: thinking blocks, every
    chat-control / tool tag (so it cannot end the turn or open a call) and control characters
    removed, trimmed to `max_chars`."""
    text = _THINK.sub("", text)
    for tag in SPECIAL_TOKEN_TEXTS.values():
        text = text.replace(tag, "")
    text = _CONTROL.sub("", text)  # control characters, and U+FFFD from cut multi-byte tokens
    return text.strip()[:max_chars].strip()


def insert_memory(messages: Sequence[Mapping], memory: str | None) -> list[dict]:
    """`messages` (a task's opening chat) with `memory` in their memory slot, or appended to
    the last message when they have none (`text.memory_slot.fill`); unchanged copies when
    `memory` is empty."""
    return memory_slot.fill(messages, memory)


def with_memory(task: Any, memory: str) -> Any:
    """`task` (a `data.tasks.Task`) with `memory` in its opening messages and in the opening
    of its reference conversation."""
    return memory_slot.opening_edited(task, lambda messages: insert_memory(messages, memory))


def conversation_plan(messages: Sequence[Mapping]) -> tuple[list[tuple[str, Any]], list[str]]:
    """The calls and response texts of a conversation, in order."""
    calls, responses = [], []
    for m in messages:
        if m.get("role") == "assistant":
            for c in m.get("tool_calls") or []:
                fn = c.get("function", c)
                args = fn.get("arguments")
                calls.append((fn.get("name"), json.loads(args) if isinstance(args, str) else args))
        elif m.get("role") == "tool":
            responses.append(str(m.get("content") or ""))
    return calls, responses


def reference_plan(task: Any) -> tuple[list[tuple[str, Any]], list[str]]:
    """The calls and response texts of a task's reference conversation, in order."""
    return conversation_plan(task.reference_messages)
