"""Forced tool calls (`tool_choice` 'required' or a named function) that hold.

A small model asked for a call often writes it without its closing `</tool_call>` (SmolLM2-135M
writes `{"name": "calculator", "arguments": {"expression": "3+4"}}` and ends its turn), copies
the tool's JSON schema into the arguments, or writes on after the call. The server therefore:

* forces the start of the call into the prompt (`prefix`): the block's opening, the name when
  it is known (a named function, or 'required' with one tool), the arguments' opening brace,
  and the first required argument's key (with its opening quote for a string): the model then
  fills in values rather than restating the schema;
* decodes the rest of the call under the tools' JSON schemas (`structured.compile_call`), so
  the model can only write a call of one of them;
* ends the reply as soon as the call's JSON object is complete (`json_end`), whatever follows;
* reads the call from that JSON (`read_call`), closing it where the reply was cut by its token
  budget (`close_json`: an open string, array or object is closed, a key without a value
  dropped).

A reply that still gives no call with a name among the tools and an object of arguments (cut
too early by `max_tokens`, or decoded free where no grammar fits) is answered as it stands, as
content with its finish reason (`length` when cut): what the model wrote is never a 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envace_jax.text.tool_calls import CALL_OPEN


def prefix(tools: Sequence[Mapping], name: str | None) -> str:
    """The forced start of a reply that must call `name` (None: one of `tools`)."""
    if name is None and len(tools) == 1:
        name = tools[0]["function"]["name"]
    if name is None:
        return CALL_OPEN + '\n{"name": "'
    head = CALL_OPEN + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": {'
    tool = next(t["function"] for t in tools if t["function"]["name"] == name)
    schema = tool.get("parameters") or {}
    required = schema.get("required") or []
    properties = schema.get("properties") or {}
    if not required or not isinstance(required[0], str):
        return head
    key = required[0]
    kind = (properties.get(key) or {}).get("type") if isinstance(properties, dict) else None
    return head + json.dumps(key) + ": " + ('"' if kind == "string" else "")


def _call_json(reply: str) -> str:
    """The text of the call's JSON object in a forced reply (from its opening brace)."""
    start = reply.find(CALL_OPEN)
    return reply[start + len(CALL_OPEN) :].lstrip() if start >= 0 else reply


def _outside_strings(text: str, end: list[bool]):
    """(index, character) of each character of `text` outside JSON strings, their quotes
    excluded; `end` becomes [in a string, after a backslash] when the scan reaches the end."""
    in_string = escaped = False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        else:
            yield i, c
    end[:] = [in_string, escaped]


def json_end(text: str) -> int | None:
    """Where the first JSON object of `text` (its first `{`) ends, or None while it is open."""
    depth = 0
    for i, c in _outside_strings(text, []):
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def close_json(text: str) -> str | None:
    """`text`, the start of a JSON value cut short, closed into a whole one: an open string is
    closed, a key without a value or a trailing comma dropped, open arrays and objects closed.
    None if that does not give JSON."""
    stack, end = [], []
    for _, c in _outside_strings(text, end):
        if c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]" and stack:
            stack.pop()
    in_string, escaped = end
    out = text[:-1] if escaped else text
    if in_string:
        out += '"'
    for attempt in (out, _drop_dangling(out)):
        if attempt is None:
            continue
        try:
            json.loads(attempt + "".join(reversed(stack)))
            return attempt + "".join(reversed(stack))
        except ValueError:
            continue
    return None


def _drop_dangling(text: str) -> str | None:
    """`text` without its last unfinished member: `, "key": ` / `, "key"` / a trailing comma
    or colon."""
    t = text.rstrip()
    if t.endswith((",", ":")):
        t = t[:-1].rstrip()
    if t.endswith('"'):  # a key (or a value): drop it back to the comma or brace before it
        start = t.rfind('"', 0, len(t) - 1)
        before = t[:start].rstrip()
        if before.endswith((",", "{")):
            return before[:-1] if before.endswith(",") else before
    return t if t != text else None


def read_call(reply: str, tools: Sequence[Mapping]) -> tuple[dict[str, Any] | None, str]:
    """(the call {name, arguments} of a forced reply, or None; why not, or '' for a call)."""
    text = _call_json(reply)
    end = json_end(text)
    whole = text[:end] if end is not None else close_json(text)
    if whole is None:
        return None, f"the reply is not a JSON object: {reply[:200]!r}"
    try:
        call = json.loads(whole)
    except ValueError as e:
        return None, f"the call is not valid JSON ({e}): {reply[:200]!r}"
    names = [t["function"]["name"] for t in tools]
    if not isinstance(call, dict) or call.get("name") not in names:
        got = call.get("name") if isinstance(call, dict) else call
        return None, f"the reply names no tool of the request ({got!r}; tools: {names})"
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None, f"the call's arguments are not a JSON object: {arguments!r}"
    return {"name": call["name"], "arguments": arguments}, ""
