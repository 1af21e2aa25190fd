"""Task records in the checklist format, and their validation.

A `Task` is one instruction: the opening chat (system + first user message), the tool schemas
the agent may call, the full reference conversation (its later user messages are replayed
verbatim, whatever the agent did), and a checklist per user turn. Each checklist item is
judged (by an LLM judge, or by a machine-checkable `rule`) on the assistant steps of its turn.

Two optional fields are ours, not the reference's: `ChecklistItem.rule` (a small dict a rule
judge can check, e.g. `{"kind": "call", "tool": ..., "args": {...}}`) and `Task.ground_truth`
(solution calls, expected final state). Both are kept opaque here: a JSON object whose `kind`
(for rules) is a string; their vocabulary belongs to the judges.

Validation collects every problem of a record and names the field path of each, e.g.
`checklist[0][2].weight: expected a number >= 0, got "high"`. Weights of one turn must sum to 1
within `DEFAULT_WEIGHT_TOLERANCE` (the annotation pipeline behind the reference data enforces
the same 1e-6), which keeps an episode score in [0, 1].
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_WEIGHT_TOLERANCE = 1e-6

# What an item may focus on (the annotation schema of the reference data). The LLM judge uses
# it: items on tool calls or tool output fail outright when a tool response carries an error.
FOCUS_ON_VALUES = (
    "assistant.tool_calls",
    "assistant.content.thinking",
    "assistant.content.user_visible_reply",
    "tool.content",
)
MESSAGE_ROLES = ("system", "user", "assistant", "tool", "observation")
JSON_SCHEMA_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")

_ITEM_KEYS = (
    "id",
    "question",
    "focus_on",
    "pass_condition",
    "failure_examples",
    "evidence",
    "weight",
    "required_for_next_turn",
    "rule",
)


class TaskValidationError(ValueError):
    """A task record is invalid. `errors` lists (field path, problem) pairs, all of them."""

    def __init__(self, errors: Sequence[tuple[str, str]]):
        self.errors = list(errors)
        super().__init__("; ".join(f"{p}: {m}" if p else m for p, m in self.errors))


def describe(value: Any, limit: int = 60) -> str:
    """A short, JSON-like rendering of a bad value for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Errors:
    """Collects (path, message) pairs so one pass reports every problem of a record."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))

    def expect(self, path: str, what: str, value: Any) -> None:
        self.add(path, f"expected {what}, got {describe(value)}")


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _str_field(d: Mapping, key: str, path: str, err: _Errors, *, required=True, nonempty=False):
    p = _join(path, key)
    if key not in d or d[key] is None:
        if required:
            err.add(p, "missing required field")
        return None
    v = d[key]
    if not isinstance(v, str) or (nonempty and not v.strip()):
        err.expect(p, "a non-empty string" if nonempty else "a string", v)
        return None
    return v


def _json_object(value: Any, path: str, err: _Errors) -> dict | None:
    if not isinstance(value, Mapping):
        err.expect(path, "a JSON object", value)
        return None
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        err.add(path, f"not JSON-serialisable: {e}")
        return None
    return dict(value)


# --------------------------------------------------------------------------------------------
# Messages and tool schemas


def _check_tool_calls(calls: Any, path: str, err: _Errors) -> None:
    if not isinstance(calls, list):
        err.expect(path, "a list of tool calls", calls)
        return
    for i, call in enumerate(calls):
        p = _join(path, i)
        if not isinstance(call, Mapping):
            err.expect(p, "a tool call object", call)
            continue
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            err.expect(_join(p, "function"), "an object with name and arguments", fn)
            continue
        _str_field(fn, "name", _join(p, "function"), err, nonempty=True)
        args = fn.get("arguments")
        ap = _join(_join(p, "function"), "arguments")
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError as e:
                err.add(ap, f"arguments string is not valid JSON ({e})")
        elif not isinstance(args, Mapping):
            err.expect(ap, "a JSON string or an object", args)


def check_messages(messages: Any, path: str, err: _Errors) -> list[dict]:
    """OpenAI chat messages: role, string content (may be empty or null for assistant tool
    calls), optional `tool_calls`. Other keys (name, tool_call_id, ...) are kept as they are."""
    if not isinstance(messages, list):
        err.expect(path, "a list of chat messages", messages)
        return []
    if not messages:
        err.add(path, "expected at least one message, got []")
    out = []
    for i, m in enumerate(messages):
        p = _join(path, i)
        if not isinstance(m, Mapping):
            err.expect(p, "a message object", m)
            continue
        role = m.get("role")
        if role not in MESSAGE_ROLES:
            err.expect(_join(p, "role"), f"one of {list(MESSAGE_ROLES)}", role)
        content = m.get("content")
        if content is None and role != "assistant":
            err.add(_join(p, "content"), "missing required field")
        elif content is not None and not isinstance(content, str):
            err.expect(_join(p, "content"), "a string", content)
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], _join(p, "tool_calls"), err)
        out.append(dict(m))
    return out


def _check_schema(schema: Any, path: str, err: _Errors, depth: int = 0) -> None:
    """A JSON-schema fragment: known `type`s, `properties` objects, `required` subsets, array
    `items`. Combinators (anyOf/oneOf/allOf) are checked branch by branch."""
    if not isinstance(schema, Mapping):
        err.expect(path, "a JSON schema object", schema)
        return
    if depth > 32:
        err.add(path, "schema nested deeper than 32 levels")
        return
    types = schema.get("type")
    if types is not None:
        tlist = types if isinstance(types, list) else [types]
        for t in tlist:
            if t not in JSON_SCHEMA_TYPES:
                err.expect(_join(path, "type"), f"a JSON schema type {list(JSON_SCHEMA_TYPES)}", t)
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, Mapping):
            err.expect(_join(path, "properties"), "an object", props)
            props = None
        else:
            for name, sub in props.items():
                _check_schema(sub, _join(_join(path, "properties"), name), err, depth + 1)
    required = schema.get("required")
    if required is not None:
        rp = _join(path, "required")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            err.expect(rp, "a list of property names", required)
        else:
            missing = [r for r in required if props is None or r not in props]
            if missing:
                err.add(rp, f"names properties that are not defined: {describe(missing)}")
    items = schema.get("items")
    if items is not None:
        if isinstance(items, list):  # tuple validation (draft 4-7)
            for i, sub in enumerate(items):
                _check_schema(sub, _join(_join(path, "items"), i), err, depth + 1)
        else:
            _check_schema(items, _join(path, "items"), err, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if branches is not None:
            if not isinstance(branches, list):
                err.expect(_join(path, key), "a list of schemas", branches)
                continue
            for i, sub in enumerate(branches):
                _check_schema(sub, _join(_join(path, key), i), err, depth + 1)


def check_tools(tools: Any, path: str, err: _Errors) -> list[dict]:
    """OpenAI function schemas `{"type": "function", "function": {name, description,
    parameters}}`; `parameters` must be a `type: object` JSON schema."""
    if not isinstance(tools, list):
        err.expect(path, "a list of tool schemas", tools)
        return []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        p = _join(path, i)
        if not isinstance(tool, Mapping):
            err.expect(p, "a tool schema object", tool)
            continue
        if tool.get("type") != "function":
            err.expect(_join(p, "type"), '"function"', tool.get("type"))
        fn = tool.get("function")
        fp = _join(p, "function")
        if not isinstance(fn, Mapping):
            err.expect(fp, "an object with name, description, parameters", fn)
            continue
        name = _str_field(fn, "name", fp, err, nonempty=True)
        if name is not None:
            if name in seen:
                msg = f"duplicate tool name {describe(name)} (first at {path}[{seen[name]}])"
                err.add(_join(fp, "name"), msg)
            seen.setdefault(name, i)
        _str_field(fn, "description", fp, err, required=False)
        params = fn.get("parameters")
        pp = _join(fp, "parameters")
        if params is None:
            err.add(pp, "missing required field")
        elif not isinstance(params, Mapping):
            err.expect(pp, "a JSON schema object", params)
        else:
            if params.get("type") != "object":
                err.expect(_join(pp, "type"), '"object"', params.get("type"))
            _check_schema(params, pp, err)
    return [dict(t) for t in tools if isinstance(t, Mapping)]


# --------------------------------------------------------------------------------------------
# Checklists


@dataclasses.dataclass(frozen=True)
class ChecklistItem:
    """One criterion of one user turn.

    `evidence` holds the reference snippets shown to the judge. Reference-data evidence entries
    are objects `{turn, step, from, snippet}`; their snippets land here and the objects without
    the snippet in `extra["evidence_sources"]`, so nothing is lost. Keys we do not model
    (`dependence`, annotation metadata) are kept in `extra` and written back by `to_dict`.
    When absent, `failure_examples` and `evidence` are empty and `required_for_next_turn` is
    false; `question`, `focus_on`, `pass_condition` and `weight` are required.
    """

    question: str
    focus_on: str
    pass_condition: str
    failure_examples: tuple[str, ...]
    evidence: tuple[str, ...]
    weight: float
    required_for_next_turn: bool
    id: str | None = None
    rule: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChecklistItem:
        err = _Errors()
        item = _parse_item(d, "", err)
        if err.items:
            raise TaskValidationError(err.items)
        return item

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
        out.update(
            question=self.question,
            focus_on=self.focus_on,
            pass_condition=self.pass_condition,
            failure_examples=list(self.failure_examples),
            evidence=self._evidence_out(),
            weight=self.weight,
            required_for_next_turn=self.required_for_next_turn,
        )
        if self.rule is not None:
            out["rule"] = dict(self.rule)
        for k, v in self.extra.items():
            if k != "evidence_sources":
                out.setdefault(k, v)
        return out

    def _evidence_out(self) -> list:
        sources = self.extra.get("evidence_sources")
        if isinstance(sources, list) and len(sources) == len(self.evidence):
            return [{**src, "snippet": s} for src, s in zip(sources, self.evidence, strict=True)]
        return list(self.evidence)


def _parse_item(d: Any, path: str, err: _Errors) -> ChecklistItem | None:
    if not isinstance(d, Mapping):
        err.expect(path, "a checklist item object", d)
        return None
    n0 = len(err.items)
    question = _str_field(d, "question", path, err, nonempty=True)
    focus_on = d.get("focus_on")
    if focus_on is None:
        err.add(_join(path, "focus_on"), "missing required field")
    elif focus_on not in FOCUS_ON_VALUES:
        err.expect(_join(path, "focus_on"), f"one of {list(FOCUS_ON_VALUES)}", focus_on)
    pass_condition = _str_field(d, "pass_condition", path, err, nonempty=True)
    item_id = _str_field(d, "id", path, err, required=False)

    fails = d.get("failure_examples", [])
    fp = _join(path, "failure_examples")
    if not isinstance(fails, list) or not all(isinstance(x, str) for x in fails):
        err.expect(fp, "a list of strings", fails)
        fails = []

    extra = {k: v for k, v in d.items() if k not in _ITEM_KEYS}
    evidence = d.get("evidence", [])
    snippets: list[str] = []
    sources: list[dict] = []
    if not isinstance(evidence, list):
        err.expect(_join(path, "evidence"), "a list of strings or {snippet} objects", evidence)
    else:
        for i, ev in enumerate(evidence):
            ep = _join(_join(path, "evidence"), i)
            if isinstance(ev, str):
                snippets.append(ev)
            elif isinstance(ev, Mapping) and isinstance(ev.get("snippet"), str):
                snippets.append(ev["snippet"])
                sources.append({k: v for k, v in ev.items() if k != "snippet"})
            else:
                err.expect(ep, "a string or an object with a string snippet", ev)
    if sources:
        if len(sources) != len(snippets):
            err.add(_join(path, "evidence"), "mixes plain strings and {snippet} objects")
        extra["evidence_sources"] = sources

    weight = d.get("weight")
    wp = _join(path, "weight")
    if weight is None:
        err.add(wp, "missing required field")
    elif not _is_number(weight) or weight < 0:
        err.expect(wp, "a number >= 0", weight)
    required = d.get("required_for_next_turn", False)
    if not isinstance(required, bool):
        err.expect(_join(path, "required_for_next_turn"), "true or false", required)

    rule = d.get("rule")
    if rule is not None:
        rp = _join(path, "rule")
        rule = _json_object(rule, rp, err)
        if rule is not None and not (isinstance(rule.get("kind"), str) and rule["kind"]):
            err.expect(_join(rp, "kind"), "a non-empty string", rule.get("kind"))
    if len(err.items) > n0:
        return None
    return ChecklistItem(
        question=question,
        focus_on=focus_on,
        pass_condition=pass_condition,
        failure_examples=tuple(fails),
        evidence=tuple(snippets),
        weight=float(weight),
        required_for_next_turn=required,
        id=item_id,
        rule=rule,
        extra=extra,
    )


Checklist = tuple[tuple[ChecklistItem, ...], ...]  # [turn][item]


def check_checklist(
    value: Any, path: str, err: _Errors, weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE
) -> Checklist:
    """[turn][item]; every turn has at least one item and its weights sum to 1."""
    if not isinstance(value, list):
        err.expect(path, "a list (one list of items per user turn)", value)
        return ()
    if not value:
        err.add(path, "expected at least one user turn, got []")
    turns = []
    for t, turn in enumerate(value):
        tp = _join(path, t)
        if not isinstance(turn, list):
            err.expect(tp, "a list of checklist items", turn)
            continue
        if not turn:
            err.add(tp, "expected at least one checklist item, got []")
            continue
        items = [_parse_item(it, _join(tp, k), err) for k, it in enumerate(turn)]
        if all(it is not None for it in items):
            total = math.fsum(it.weight for it in items)
            if abs(total - 1.0) > weight_tolerance:
                err.add(tp, f"item weights sum to {total:.8g}, expected 1 (±{weight_tolerance:g})")
            turns.append(tuple(items))
    return tuple(turns)


# --------------------------------------------------------------------------------------------
# Task


def _freeze_messages(msgs: Sequence[Mapping]) -> tuple[dict, ...]:
    return tuple(dict(m) for m in msgs)


@dataclasses.dataclass(frozen=True)
class Task:
    """One training or evaluation instruction.

    messages: opening chat, ending with the first user message (exactly one user message).
    tools: OpenAI function schemas available to the agent.
    reference_messages: the full reference conversation; user turn t > 0 replays its t-th
      user message. It holds exactly `len(checklist)` user messages.
    checklist: [turn][item] for the checklist the reward uses.
    extra_checklists: further checklists of the same task (reference data may carry several;
      the reference trains with the first only).
    ground_truth: opaque JSON object (solution calls, expected final state) for rule judges.
    metadata: opaque JSON object (data_source, original index, ...).
    """

    task_id: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    reference_messages: tuple[dict, ...]
    checklist: Checklist
    extra_checklists: tuple[Checklist, ...] = ()
    ground_truth: Mapping[str, Any] | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def template_tools(self) -> list[Mapping[str, Any]] | None:
        """The tools to render through the chat template's tools block: `tools`, unless the
        task describes its tools in its own messages (metadata `render_tools: false`)."""
        if not self.tools or self.metadata.get("render_tools", True) is False:
            return None
        return list(self.tools)

    @property
    def num_turns(self) -> int:
        """User turns of the episode (the reference's `max_num_turns`)."""
        return len(self.checklist)

    @property
    def checklists(self) -> tuple[Checklist, ...]:
        return (self.checklist, *self.extra_checklists)

    def user_message(self, turn: int) -> dict:
        """The reference conversation's user message that opens `turn` (0-based)."""
        users = [m for m in self.reference_messages if m.get("role") == "user"]
        return users[turn]

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], *, weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE
    ) -> Task:
        """Parse our own layout (the keys of `to_dict`); raise TaskValidationError naming every
        bad field."""
        err = _Errors()
        task = parse_task(d, err, weight_tolerance=weight_tolerance)
        if err.items:
            raise TaskValidationError(err.items)
        return task

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "task_id": self.task_id,
            "messages": [dict(m) for m in self.messages],
            "tools": [dict(t) for t in self.tools],
            "reference_messages": [dict(m) for m in self.reference_messages],
            "checklist": [[it.to_dict() for it in turn] for turn in self.checklist],
        }
        if self.extra_checklists:
            out["extra_checklists"] = [
                [[it.to_dict() for it in turn] for turn in cl] for cl in self.extra_checklists
            ]
        if self.ground_truth is not None:
            out["ground_truth"] = dict(self.ground_truth)
        if self.metadata:
            out["metadata"] = dict(self.metadata)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, sort_keys=True)


_TASK_KEYS = (
    "task_id",
    "messages",
    "tools",
    "reference_messages",
    "checklist",
    "extra_checklists",
    "ground_truth",
    "metadata",
)


def parse_task(
    d: Any,
    err: _Errors,
    *,
    weight_tolerance: float = DEFAULT_WEIGHT_TOLERANCE,
    paths: Mapping[str, str] | None = None,
) -> Task | None:
    """Validate and build a Task from our layout. `paths` renames fields in error messages
    (readers use it to report the reference layout's own field paths)."""
    paths = dict(paths or {})
    P = lambda key: paths.get(key, key)  # noqa: E731
    if not isinstance(d, Mapping):
        err.expect("", "a task object", d)
        return None
    n0 = len(err.items)
    unknown = sorted(set(d) - set(_TASK_KEYS))
    if unknown:
        err.add("", f"unknown fields {unknown}; expected a subset of {list(_TASK_KEYS)}")
    task_id = d.get("task_id")
    if task_id is None:
        err.add(P("task_id"), "missing required field")
    elif isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or task_id == "":
        err.expect(P("task_id"), "a non-empty string", task_id)
    if "messages" not in d:
        err.add(P("messages"), "missing required field")
    messages = check_messages(d.get("messages", []), P("messages"), err)
    if "tools" not in d:
        err.add(P("tools"), "missing required field")
    tools = check_tools(d.get("tools", []), P("tools"), err)
    if "checklist" not in d:
        err.add(P("checklist"), "missing required field")
        checklist: Checklist = ()
    else:
        checklist = check_checklist(d["checklist"], P("checklist"), err, weight_tolerance)
    extra = d.get("extra_checklists") or []
    extra_cls: list[Checklist] = []
    if not isinstance(extra, list):
        err.expect(P("extra_checklists"), "a list of checklists", extra)
    else:
        for c, cl in enumerate(extra):
            cp = paths.get(f"extra_checklists[{c}]", _join("extra_checklists", c))
            extra_cls.append(check_checklist(cl, cp, err, weight_tolerance))
    ref = d.get("reference_messages")
    if ref is None:  # single-turn tasks may omit it: the opening chat is the whole reference
        ref_msgs = list(messages)
    else:
        ref_msgs = check_messages(ref, P("reference_messages"), err)

    ground_truth = d.get("ground_truth")
    if ground_truth is not None:
        ground_truth = _json_object(ground_truth, P("ground_truth"), err)
    metadata = d.get("metadata") or {}
    metadata = _json_object(metadata, P("metadata"), err) or {}

    if len(err.items) == n0:
        # Replay needs: one user message in the opening chat, one reference user message per
        # checklist turn, and the opening user message to be the reference's first.
        n_open = sum(m.get("role") == "user" for m in messages)
        if n_open != 1 or messages[-1].get("role") != "user":
            err.add(
                P("messages"),
                f"expected an opening chat ending with its only user message, found {n_open} "
                f"user messages and a final {describe(messages[-1].get('role'))} message",
            )
        ref_users = [m for m in ref_msgs if m.get("role") == "user"]
        turns = [len(checklist)] + [len(c) for c in extra_cls]
        if len(ref_users) != turns[0]:
            err.add(
                P("reference_messages") if ref is not None else P("checklist"),
                f"reference conversation has {len(ref_users)} user messages but the checklist "
                f"has {turns[0]} turns",
            )
        if any(n != turns[0] for n in turns[1:]):
            err.add(P("extra_checklists"), f"checklists disagree on the number of turns {turns}")
        first = (messages[-1].get("content") or "").strip()
        if ref_users and n_open == 1 and (ref_users[0].get("content") or "").strip() != first:
            err.add(
                P("reference_messages"),
                "first user message differs from the opening chat's user message",
            )
    if len(err.items) > n0:
        return None
    return Task(
        task_id=str(task_id),
        messages=_freeze_messages(messages),
        tools=tuple(tools),
        reference_messages=_freeze_messages(ref_msgs),
        checklist=checklist,
        extra_checklists=tuple(extra_cls),
        ground_truth=ground_truth,
        metadata=metadata,
    )
