"""Validation building blocks for task records: an error collector that names field paths,
and the checks of OpenAI chat messages and tool (function) schemas.

Validation collects every problem of a record and names the field path of each, e.g.
`checklist[0][2].weight: expected a number >= 0, got "high"`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

# An unpaired UTF-16 surrogate: JSON's "\ud800" escape makes one, and no text encoding (nor
# tokenizer) can hold it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

MESSAGE_ROLES = ("system", "user", "assistant", "tool", "observation")
JSON_SCHEMA_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")


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


class Errors:
    """Collects (path, message) pairs so one pass reports every problem of a record."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))

    def expect(self, path: str, what: str, value: Any) -> None:
        self.add(path, f"expected {what}, got {describe(value)}")


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of the first string (or key) in a JSON-like value that holds a lone surrogate,
    or None. Iterative: a record may nest deeper than Python's recursion limit."""
    stack = [(path, value)]
    while stack:
        p, v = stack.pop()
        if isinstance(v, str):
            if LONE_SURROGATE.search(v):
                return p or "(the record)"
        elif isinstance(v, Mapping):
            for k in v:
                if isinstance(k, str) and LONE_SURROGATE.search(k):
                    return f"{p or '(the record)'} (the key {ascii(k)})"
            stack.extend((join_path(p, str(k)), x) for k, x in reversed(list(v.items())))
        elif isinstance(v, list | tuple):
            stack.extend((join_path(p, i), x) for i, x in reversed(list(enumerate(v))))
    return None


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def typed_entries(items: Sequence, path: str, err: Errors, kind: type, what: str):
    """(index, path, entry) of each entry of `items` that is a `kind`; any other entry is
    reported as not `what`."""
    for i, entry in enumerate(items):
        p = join_path(path, i)
        if isinstance(entry, kind):
            yield i, p, entry
        else:
            err.expect(p, what, entry)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def str_field(d: Mapping, key: str, path: str, err: Errors, *, required=True, nonempty=False):
    p = join_path(path, key)
    if key not in d or d[key] is None:
        if required:
            err.add(p, "missing required field")
        return None
    v = d[key]
    if not isinstance(v, str) or (nonempty and not v.strip()):
        err.expect(p, "a non-empty string" if nonempty else "a string", v)
        return None
    return v


def json_object(value: Any, path: str, err: Errors) -> dict | None:
    if not isinstance(value, Mapping):
        err.expect(path, "a JSON object", value)
        return None
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        err.add(path, f"not JSON-serialisable: {e}")
        return None
    return dict(value)


def _check_tool_calls(calls: Any, path: str, err: Errors) -> None:
    if not isinstance(calls, list):
        err.expect(path, "a list of tool calls", calls)
        return
    for _, p, call in typed_entries(calls, path, err, Mapping, "a tool call object"):
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            err.expect(join_path(p, "function"), "an object with name and arguments", fn)
            continue
        str_field(fn, "name", join_path(p, "function"), err, nonempty=True)
        args = fn.get("arguments")
        ap = join_path(join_path(p, "function"), "arguments")
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError as e:
                err.add(ap, f"arguments string is not valid JSON ({e})")
        elif not isinstance(args, Mapping):
            err.expect(ap, "a JSON string or an object", args)


def check_messages(messages: Any, path: str, err: Errors) -> list[dict]:
    """OpenAI chat messages: role, string content (may be empty or null for assistant tool
    calls), optional `tool_calls`. Other keys (name, tool_call_id, ...) are kept as they are."""
    if not isinstance(messages, list):
        err.expect(path, "a list of chat messages", messages)
        return []
    if not messages:
        err.add(path, "expected at least one message, got []")
    out = []
    for _, p, m in typed_entries(messages, path, err, Mapping, "a message object"):
        role = m.get("role")
        if role not in MESSAGE_ROLES:
            err.expect(join_path(p, "role"), f"one of {list(MESSAGE_ROLES)}", role)
        content = m.get("content")
        if content is None and role != "assistant":
            err.add(join_path(p, "content"), "missing required field")
        elif content is not None and not isinstance(content, str):
            err.expect(join_path(p, "content"), "a string", content)
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], join_path(p, "tool_calls"), err)
        out.append(dict(m))
    return out


def _check_schema(schema: Any, path: str, err: Errors, depth: int = 0) -> None:
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
                err.expect(
                    join_path(path, "type"), f"a JSON schema type {list(JSON_SCHEMA_TYPES)}", t
                )
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, Mapping):
            err.expect(join_path(path, "properties"), "an object", props)
            props = None
        else:
            for name, sub in props.items():
                _check_schema(sub, join_path(join_path(path, "properties"), name), err, depth + 1)
    required = schema.get("required")
    if required is not None:
        rp = join_path(path, "required")
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
                _check_schema(sub, join_path(join_path(path, "items"), i), err, depth + 1)
        else:
            _check_schema(items, join_path(path, "items"), err, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if branches is not None:
            if not isinstance(branches, list):
                err.expect(join_path(path, key), "a list of schemas", branches)
                continue
            for i, sub in enumerate(branches):
                _check_schema(sub, join_path(join_path(path, key), i), err, depth + 1)


def check_tools(tools: Any, path: str, err: Errors) -> list[dict]:
    """OpenAI function schemas `{"type": "function", "function": {name, description,
    parameters}}`; `parameters` must be a `type: object` JSON schema."""
    if not isinstance(tools, list):
        err.expect(path, "a list of tool schemas", tools)
        return []
    seen: dict[str, int] = {}
    for i, p, tool in typed_entries(tools, path, err, Mapping, "a tool schema object"):
        if tool.get("type") != "function":
            err.expect(join_path(p, "type"), '"function"', tool.get("type"))
        fn = tool.get("function")
        fp = join_path(p, "function")
        if not isinstance(fn, Mapping):
            err.expect(fp, "an object with name, description, parameters", fn)
            continue
        name = str_field(fn, "name", fp, err, nonempty=True)
        if name is not None:
            if name in seen:
                msg = f"duplicate tool name {describe(name)} (first at {path}[{seen[name]}])"
                err.add(join_path(fp, "name"), msg)
            seen.setdefault(name, i)
        str_field(fn, "description", fp, err, required=False)
        params = fn.get("parameters")
        pp = join_path(fp, "parameters")
        if params is None:
            err.add(pp, "missing required field")
        elif not isinstance(params, Mapping):
            err.expect(pp, "a JSON schema object", params)
        else:
            if params.get("type") != "object":
                err.expect(join_path(pp, "type"), '"object"', params.get("type"))
            _check_schema(params, pp, err)
    return [dict(t) for t in tools if isinstance(t, Mapping)]
