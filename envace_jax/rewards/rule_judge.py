"""Rule judge: scores a trajectory (chat messages) against the machine-checkable `rule`s of a
task's checklist, with no model in the loop.

The trajectory's tool messages may be *rehearsed* (written by the policy, not by a real
environment), so rules come in two kinds:

* ground truth, fixed when the task was made: ``call`` (some call has exactly these name and
  arguments) and ``reply_states`` (the final reply states these values);
* the outcome, fixed when the task was made: ``effects`` (when the final reply is given, the
  calls of the state-changing ``tools`` that succeeded are exactly ``calls``, as a multiset:
  nothing missing, nothing extra; with ``no_refusals``, also none of those tools' calls was
  refused by the world, i.e. answered with a domain error);
* consistency with the trajectory's own observations: ``arg_from`` (an argument of a call
  equals a value that an earlier result of the ``source`` tool returned) and ``reply_from``
  (the final reply states the ``key`` of the last ``source`` result).

A rehearsal that invents a wrong id which the actor then uses consistently passes the
consistency items and fails the ground-truth ones, so the outcome still penalises it.

Rule vocabulary (``ChecklistItem.rule``):

    {"kind": "call", "tool": str, "args": {...}}
    {"kind": "arg_from", "tool": str, "arg": str, "source": str}
    {"kind": "reply_states", "values": [str, ...]}
    {"kind": "reply_from", "source": str, "key": str}
    {"kind": "effects", "tools": [str, ...], "calls": [{"name": str, "arguments": {...}}, ...],
     "no_refusals": bool (optional, default false)}

Each item is checked on every assistant step of its turn; the turn's verdicts are aggregated
by the reference's checklist semantics (see `envace_jax.rewards.checklist`): an item passes
if any step satisfies it, a call error in a turn zeroes it and ends the episode.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from envace_jax.envs.base import (
    canonical,
    effects_key,
    error_code,
    is_call_error,
    observed_values,
    parse_result_text,
)
from envace_jax.rewards.checklist import aggregate, score_turn

RULE_KINDS = ("call", "arg_from", "reply_states", "reply_from", "effects")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Call:
    """One tool call of an assistant step and the result that followed it (None if absent)."""

    name: str
    arguments: Any
    result: Any = None


@dataclasses.dataclass(frozen=True)
class Step:
    """One assistant message: its calls (with results) or, with no calls, its reply text."""

    calls: tuple[Call, ...]
    reply: str | None

    @property
    def call_error(self) -> bool:
        return any(c.result is not None and is_call_error(c.result) for c in self.calls)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _calls_of(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    calls = message.get("tool_calls")
    out = []
    for tc in calls if isinstance(calls, list) else []:
        fn = tc.get("function", tc) if isinstance(tc, Mapping) else {}
        fn = fn if isinstance(fn, Mapping) else {}
        out.append((str(fn.get("name", "")), _arguments(fn.get("arguments"))))
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def split_turns(messages: Sequence[Mapping[str, Any]]) -> list[list[Step]]:
    """The assistant steps of each user turn. Tool messages after an assistant message are
    paired with its calls in order; their content is parsed as JSON (text that is not a JSON
    object reads as a ``bad_observation`` call error)."""
    turns: list[list[Step]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        role = m.get("role")
        i += 1
        if role == "user":
            turns.append([])
        elif role == "assistant" and turns:
            calls = _calls_of(m)
            results = []
            while i < len(messages) and messages[i].get("role") in ("tool", "observation"):
                results.append(parse_result_text(_text(messages[i].get("content"))))
                i += 1
            if not calls and results:  # a tool message with no call: keep its error visible
                calls = [("", None)] * len(results)
            paired = [
                Call(n, a, results[k] if k < len(results) else None)
                for k, (n, a) in enumerate(calls)
            ]
            reply = None if calls else _THINK.sub("", _text(m.get("content"))).strip()
            turns[-1].append(Step(tuple(paired), reply))
    return turns


def states_value(text: str, value: Any) -> bool:
    """Whether `text` states `value` as a whole word."""
    return re.search(rf"(?<!\w){re.escape(str(value))}(?!\w)", text) is not None


def _observed(history: Sequence[Call], source: str) -> list[Any]:
    return [
        v
        for c in history
        if c.name == source and c.result is not None and error_code(c.result) is None
        for v in observed_values(c.result)
    ]


def _refused(result: Any) -> bool:
    """A domain error: the world declined a well-formed call (a call error never reached it)."""
    return error_code(result) is not None and not is_call_error(result)


def check_rule(rule: Mapping[str, Any], step: Step, history: Sequence[Call]) -> bool:
    """Whether one assistant `step` satisfies `rule`, given every earlier call of the
    trajectory (`history`, with results) for the consistency kinds."""
    kind = rule.get("kind")
    if kind == "call":
        want = canonical(rule["args"])
        return any(c.name == rule["tool"] and canonical(c.arguments) == want for c in step.calls)
    if kind == "arg_from":
        seen = {canonical(v) for v in _observed(history, rule["source"])}
        return any(
            c.name == rule["tool"]
            and isinstance(c.arguments, Mapping)
            and rule["arg"] in c.arguments
            and canonical(c.arguments[rule["arg"]]) in seen
            for c in step.calls
        )
    if kind == "reply_states":
        return step.reply is not None and all(states_value(step.reply, v) for v in rule["values"])
    if kind == "reply_from":
        if step.reply is None:
            return False
        last = [
            c.result[rule["key"]]
            for c in history
            if c.name == rule["source"]
            and isinstance(c.result, Mapping)
            and error_code(c.result) is None
            and rule["key"] in c.result
        ]
        return bool(last) and states_value(step.reply, last[-1])
    if kind == "effects":
        if step.reply is None:
            return False
        made = [
            (c.name, c.arguments)
            for c in history
            if c.name in rule["tools"] and c.result is not None and error_code(c.result) is None
        ]
        want = [(c["name"], c["arguments"]) for c in rule["calls"]]
        if rule.get("no_refusals") and any(
            c.name in rule["tools"] and c.result is not None and _refused(c.result) for c in history
        ):
            return False
        return effects_key(made) == effects_key(want)
    raise ValueError(f"unknown rule kind {kind!r}; expected one of {RULE_KINDS}")


def step_verdicts(task: Any, messages: Sequence[Mapping[str, Any]]) -> list[list[list[bool]]]:
    """[turn][step][item]: whether each assistant step of each user turn satisfies each item
    of that turn's checklist (turns beyond the checklist are ignored)."""
    checklist = task.checklist
    for t, turn in enumerate(checklist):
        for k, item in enumerate(turn):
            if item.rule is None:
                raise ValueError(f"task {task.task_id}: checklist[{t}][{k}] has no rule")
    history: list[Call] = []
    out = []
    for t, steps in enumerate(split_turns(messages)[: len(checklist)]):
        per_step = []
        for step in steps:
            per_step.append([check_rule(item.rule, step, history) for item in checklist[t]])
            history.extend(step.calls)
        out.append(per_step)
    return out


@dataclasses.dataclass(frozen=True)
class RuleJudgement:
    """score in [0, 1]; passed[turn][item] for the turns played (all False in a turn a call
    error zeroed); verdicts[turn][step][item] per assistant step; per_turn turn rewards;
    ended_early_reason as in `envace_jax.rewards.checklist` (None when all turns ran)."""

    score: float
    passed: tuple[tuple[bool, ...], ...]
    verdicts: tuple[tuple[tuple[bool, ...], ...], ...]
    per_turn: tuple[float, ...]
    ended_early_reason: str | None
    call_error: bool


def judge(task: Any, messages: Sequence[Mapping[str, Any]]) -> RuleJudgement:
    """Score a trajectory (the whole chat, opening messages included) against `task`'s rule
    checklist. Turns are played until the checklist's semantics end the episode (a call error,
    a failed required item); verdicts of later turns are dropped."""
    return judge_verdicts(task, messages, step_verdicts(task, messages))


def judge_verdicts(
    task: Any,
    messages: Sequence[Mapping[str, Any]],
    verdicts: Sequence[Sequence[Sequence[bool]]],
    judge_failed: Sequence[bool] = (),
) -> RuleJudgement:
    """The episode's judgement from item verdicts[turn][step][item], whoever gave them (the
    rules, or an LLM judge); `judge_failed[t]`: turn t has an item without a verdict."""
    checklist = task.checklist
    errors = [any(s.call_error for s in steps) for steps in split_turns(messages)]
    passed, played = [], 0
    for t, table in enumerate(verdicts):
        out = score_turn(
            [checklist[t]],
            [table],
            tool_error=errors[t],
            judge_failed=bool(judge_failed[t]) if t < len(judge_failed) else False,
            last_turn=t == len(checklist) - 1,
        )
        passed.append(out.passed[0])
        played = t + 1
        if out.end_episode:
            break
    ep = aggregate(checklist, verdicts[:played], errors[:played])
    return RuleJudgement(
        score=ep.score,
        passed=tuple(passed),
        verdicts=tuple(tuple(tuple(row) for row in table) for table in verdicts[:played]),
        per_turn=ep.per_turn,
        ended_early_reason=ep.ended_early_reason,
        call_error=any(errors[:played]),
    )
