"""Tool calls and tool responses in the Qwen3 text layout: parse, validate, format.

An ACT message is free text optionally followed by blocks::

    content\\n<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>\\n<tool_call>...

:func:`parse_tool_calls` turns model text into a :class:`ParsedAction`. It never raises on any
input string: an unusable action is reported as a structured :class:`ToolCallError` (a
rollout records it as an invalid-action status). As in the reference implementation, a block
may hold a JSON list of calls, ``parameters`` is accepted for ``arguments``, and one bad block
invalidates every call of the message. Text with no ``<tool_call>`` is a final reply.

A REHEARSE span holds one response per call (see ``role_pieces``)::

    body1\\n</tool_response>\\n<tool_response>\\nbody2\\n</tool_response><|im_end|>

:func:`parse_tool_responses` splits it. Strings reaching the tokenizer are sanitised: lone
surrogates, NUL and Unicode noncharacters become U+FFFD (the Rust tokenizers refuse them).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
TURN_END = "<|im_end|>"
TURN_START = "<|im_start|>"


class ErrorCode(str, enum.Enum):
    """Outcome codes of parsing an ACT message. NO_TOOL_CALL is a final reply, not an error."""

    NO_TOOL_CALL = "NO_TOOL_CALL"
    UNCLOSED_BLOCK = "UNCLOSED_BLOCK"  # <tool_call> without </tool_call> (or opened twice)
    JSON_DECODE_ERROR = "JSON_DECODE_ERROR"  # block body is not JSON
    INVALID_CALL = "INVALID_CALL"  # block JSON is not an object or a non-empty list of objects
    MISSING_NAME = "MISSING_NAME"
    MISSING_ARGUMENTS = "MISSING_ARGUMENTS"
    NON_DICT_ARGUMENTS = "NON_DICT_ARGUMENTS"
    UNKNOWN_TOOL = "UNKNOWN_TOOL"  # name not among the given tools
    SCHEMA_MISMATCH = "SCHEMA_MISMATCH"  # arguments violate the tool's JSON schema


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    code: ErrorCode
    message: str


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``raw`` is the stripped text of the block it came from."""

    name: str
    arguments: dict
    raw: str

    def to_openai(self) -> dict:
        """OpenAI-format call (arguments as a JSON string), as chat templates accept it."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedAction:
    """An ACT message split into its text ``content`` and its ``calls`` (empty on error)."""

    content: str
    calls: tuple[ToolCall, ...]
    error: ToolCallError | None

    @property
    def is_final_reply(self) -> bool:
        return self.error is None and not self.calls

    @property
    def code(self) -> ErrorCode | None:
        """NO_TOOL_CALL for a final reply, the error code for a bad action, None for calls."""
        if self.error is not None:
            return self.error.code
        return ErrorCode.NO_TOOL_CALL if not self.calls else None


# ---------------------------------------------------------------------------------------------
# Sanitisation


def _bad_code_point(c: int) -> bool:
    return (
        0xD800 <= c <= 0xDFFF  # lone surrogates
        or c == 0
        or 0xFDD0 <= c <= 0xFDEF  # noncharacter block
        or (c & 0xFFFE) == 0xFFFE  # U+xFFFE / U+xFFFF on every plane
    )


def sanitize_text(text: str) -> str:
    """Replace surrogates, NUL and noncharacters with U+FFFD (the tokenizer cannot encode them)."""
    if all(not _bad_code_point(ord(ch)) for ch in text):
        return text
    return "".join("\ufffd" if _bad_code_point(ord(ch)) else ch for ch in text)


def sanitize_json(obj: Any) -> Any:
    """:func:`sanitize_text` applied to every string (keys included) of a JSON-like value."""
    if isinstance(obj, str):
        return sanitize_text(obj)
    if isinstance(obj, Mapping):
        return {sanitize_json(k): sanitize_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize_json(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# A small JSON-schema validator (the subset tool schemas use).

_TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _json_type(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _is_type(value: Any, expected: str) -> bool:
    if expected == "string":
        return isinstance(value, str)
    if expected == "boolean":
        return isinstance(value, bool)
    if expected == "integer":
        if isinstance(value, bool):
            return False
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "array":
        return isinstance(value, list)
    if expected == "object":
        return isinstance(value, dict)
    if expected == "null":
        return value is None
    return True  # unknown type keyword: do not reject


def _same(a: Any, b: Any) -> bool:
    # JSON distinguishes true from 1, Python does not.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


# A size bound's message: {size} is the number, or the length of the string or list; {bound}
# the keyword's value.
_BOUND_MESSAGES = {
    "minimum": "{size} is below the minimum {bound}",
    "maximum": "{size} is above the maximum {bound}",
    "minLength": "shorter than {bound} characters",
    "maxLength": "longer than {bound} characters",
    "minItems": "fewer than {bound} items",
    "maxItems": "more than {bound} items",
}


def _broken_bound(value: Any, schema: Mapping) -> str | None:
    """The message of the first size bound of `schema` that `value` breaks, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size, low, high, kind = value, "minimum", "maximum", (int, float)
    elif isinstance(value, str):
        size, low, high, kind = len(value), "minLength", "maxLength", int
    elif isinstance(value, list):
        size, low, high, kind = len(value), "minItems", "maxItems", int
    else:
        return None
    lo, hi = schema.get(low), schema.get(high)
    if isinstance(lo, kind) and size < lo:
        return _BOUND_MESSAGES[low].format(size=size, bound=lo)
    if isinstance(hi, kind) and size > hi:
        return _BOUND_MESSAGES[high].format(size=size, bound=hi)
    return None


def validate_schema(value: Any, schema: Any, path: str = "arguments") -> str | None:
    """First violation of ``schema`` by ``value`` as a message naming its path, or None.

    Supports type (incl. lists of types), enum, const, properties, required,
    additionalProperties (false or a schema), items, anyOf/oneOf, minimum/maximum,
    minLength/maxLength, minItems/maxItems. Other keywords are ignored.
    """
    if not isinstance(schema, Mapping):
        return None
    expected = schema.get("type")
    if expected is not None:
        options = expected if isinstance(expected, list) else [expected]
        if not any(_is_type(value, t) for t in options if isinstance(t, str)):
            return f"{path}: expected {expected}, got {_json_type(value)}"
    if "enum" in schema and isinstance(schema["enum"], list):
        if not any(_same(value, e) for e in schema["enum"]):
            return f"{path}: {json.dumps(value, ensure_ascii=False)} is not one of {schema['enum']}"
    if "const" in schema and not _same(value, schema["const"]):
        return f"{path}: must be {json.dumps(schema['const'], ensure_ascii=False)}"
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        if isinstance(subs, list) and subs:
            if all(validate_schema(value, s, path) is not None for s in subs):
                return f"{path}: matches none of the {key} alternatives"
    broken = _broken_bound(value, schema)
    if broken:
        return f"{path}: {broken}"
    if isinstance(value, dict):
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        required = schema.get("required")
        for key in required if isinstance(required, list) else []:
            if key not in value:
                return f"{path}: missing required property {key!r}"
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                err = validate_schema(item, props[key], f"{path}.{key}")
            elif extra is False:
                err = f"{path}: unexpected property {key!r}"
            else:
                err = validate_schema(item, extra, f"{path}.{key}")
            if err:
                return err
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                err = validate_schema(item, items, f"{path}[{i}]")
                if err:
                    return err
    return None


def tool_parameter_schemas(tools: Iterable[Mapping]) -> dict[str, Any]:
    """name -> parameters schema, for OpenAI-format tools (``{"type": "function", "function":
    {...}}``) or bare ``{"name", "parameters"}`` dicts. Raises ValueError naming a bad entry."""
    schemas = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}] has no function name: {tool!r}")
        schemas[name] = fn.get("parameters", {})
    return schemas


# ---------------------------------------------------------------------------------------------
# Parsing ACT messages


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _calls_in_block(body: str, index: int) -> tuple[list[ToolCall], ToolCallError | None]:
    where = f"tool call block {index + 1}"
    stripped = body.strip()
    try:
        value = json.loads(stripped, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        return [], ToolCallError(ErrorCode.JSON_DECODE_ERROR, f"{where} is not valid JSON: {e}")
    items = value if isinstance(value, list) else [value]
    if not items:
        return [], ToolCallError(ErrorCode.INVALID_CALL, f"{where} holds an empty list")
    calls = []
    for j, item in enumerate(items):
        at = f"{where}" if not isinstance(value, list) else f"{where}, call {j + 1}"
        if not isinstance(item, dict):
            msg = f"{at} is a JSON {_json_type(item)}, not an object"
            return [], ToolCallError(ErrorCode.INVALID_CALL, msg)
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            return [], ToolCallError(ErrorCode.MISSING_NAME, f'{at} has no non-empty "name"')
        args = item.get("arguments")
        if args is None:
            args = item.get("parameters")
        if args is None:
            msg = f'{at} ({name.strip()}) has no "arguments" (use {{}} for none)'
            return [], ToolCallError(ErrorCode.MISSING_ARGUMENTS, msg)
        if isinstance(args, str):  # arguments double-encoded as a JSON string
            try:
                args = json.loads(args, parse_constant=_reject_constant)
            except (ValueError, RecursionError):
                pass
        if not isinstance(args, dict):
            msg = f'{at} ({name.strip()}): "arguments" is a JSON {_json_type(args)}, not an object'
            return [], ToolCallError(ErrorCode.NON_DICT_ARGUMENTS, msg)
        calls.append(ToolCall(sanitize_text(name.strip()), sanitize_json(args), stripped))
    return calls, None


def _check_tools(calls: list[ToolCall], schemas: dict[str, Any]) -> ToolCallError | None:
    for i, call in enumerate(calls):
        if call.name not in schemas:
            known = ", ".join(sorted(schemas)) or "none"
            msg = f"call {i + 1}: unknown tool {call.name!r} (available: {known})"
            return ToolCallError(ErrorCode.UNKNOWN_TOOL, msg)
        try:
            err = validate_schema(call.arguments, schemas[call.name])
        except RecursionError:
            err = "arguments: nested too deeply to validate"
        if err:
            return ToolCallError(ErrorCode.SCHEMA_MISMATCH, f"call {i + 1} ({call.name}): {err}")
    return None


def parse_tool_calls(text: str, tools: Sequence[Mapping] | None = None) -> ParsedAction:
    """Parse an ACT message (without its stop token). Never raises on any string ``text``.

    ``content`` is the text before the first ``<tool_call>`` less the one newline the layout
    puts before it. With ``tools`` given, names must be among them and arguments must match
    their parameter schema. A malformed ``tools`` list (not model output) raises ValueError.
    """
    schemas = tool_parameter_schemas(tools) if tools is not None else None
    text = sanitize_text(text) if isinstance(text, str) else ""
    first = text.find(CALL_OPEN)
    if first < 0:
        return ParsedAction(text, (), None)
    content = text[:first]
    content = content[:-1] if content.endswith("\n") else content
    calls: list[ToolCall] = []
    start, index = first, 0
    while start >= 0:
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        reopened = text.find(CALL_OPEN, body_start)
        if end < 0 or 0 <= reopened < end:
            msg = f"tool call block {index + 1} (at character {start}) is never closed"
            return ParsedAction(content, (), ToolCallError(ErrorCode.UNCLOSED_BLOCK, msg))
        block_calls, error = _calls_in_block(text[body_start:end], index)
        if error is not None:
            return ParsedAction(content, (), error)
        calls.extend(block_calls)
        start, index = text.find(CALL_OPEN, end + len(CALL_CLOSE)), index + 1
    if schemas is not None:
        error = _check_tools(calls, schemas)
        if error is not None:
            return ParsedAction(content, (), error)
    return ParsedAction(content, tuple(calls), None)


# ---------------------------------------------------------------------------------------------
# Formatting


def _name_and_arguments(call: ToolCall | Mapping) -> tuple[str, Any]:
    if isinstance(call, ToolCall):
        return call.name, call.arguments
    fn = call.get("function", call)
    args = fn.get("arguments", fn.get("parameters", {}))
    return fn["name"], args


def format_tool_call(call: ToolCall | Mapping) -> str:
    """One block in the chat template's layout. Accepts a ToolCall, ``{"name", "arguments"}``
    or an OpenAI call; string arguments are written verbatim, objects as compact-spaced JSON
    (what the template's ``tojson`` writes)."""
    name, args = _name_and_arguments(call)
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    body = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args_text}}}'
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def format_tool_calls(calls: Iterable[ToolCall | Mapping]) -> str:
    """Blocks separated by newlines, exactly as the template renders an assistant's calls."""
    return "\n".join(format_tool_call(c) for c in calls)


def format_action(content: str, calls: Iterable[ToolCall | Mapping] = ()) -> str:
    """The text of an assistant message with these calls (before its stop token)."""
    blocks = format_tool_calls(calls)
    if not blocks:
        return content
    return f"{content}\n{blocks}" if content else blocks


# ---------------------------------------------------------------------------------------------
# Tool responses


def parse_tool_responses(
    text_or_ids: str | Sequence[int], num_calls: int | None = None, tokenizer=None
) -> tuple[list[str], str | None]:
    """Split a tool-response turn into one response per call.

    Accepts a REHEARSE span (``body\\n</tool_response>\\n<tool_response>\\nbody2\\n
    </tool_response><|im_end|>``), a whole turn (with ``<|im_start|>user\\n<tool_response>\\n``)
    or token ids (then ``tokenizer`` decodes them). Returns ``(responses, problem)``; ``problem``
    is None when the turn is well formed and, if ``num_calls`` is given, holds one response per
    call; otherwise it says what is wrong. Never raises on a string.
    """
    if isinstance(text_or_ids, str):
        text = text_or_ids
    else:
        if tokenizer is None:
            raise ValueError("parse_tool_responses needs a tokenizer to decode token ids")
        text = tokenizer.decode(list(text_or_ids), skip_special_tokens=False)
    text = sanitize_text(text)
    problems = []
    cut = text.find(TURN_END)
    if cut >= 0:
        text = text[:cut]
    if text.startswith(TURN_START + "user"):
        text = text[len(TURN_START + "user") :]
    if text.lstrip().startswith(RESPONSE_OPEN):
        text = text.lstrip()[len(RESPONSE_OPEN) :]
        text = text[1:] if text.startswith("\n") else text
    parts = text.split(RESPONSE_CLOSE)
    tail = parts.pop()
    if not parts:  # never closed: the whole text is one response
        parts, tail = [tail], ""
        problems.append(f"the response is not closed with {RESPONSE_CLOSE}")
    if tail.strip():
        problems.append(f"text after the last {RESPONSE_CLOSE}: {tail.strip()[:80]!r}")
    responses = []
    for i, part in enumerate(parts):
        if i > 0:
            stripped = part.lstrip()
            if stripped.startswith(RESPONSE_OPEN):
                part = stripped[len(RESPONSE_OPEN) :]
                part = part[1:] if part.startswith("\n") else part
            else:
                problems.append(f"response {i + 1} does not start with {RESPONSE_OPEN}")
        responses.append(part[:-1] if part.endswith("\n") else part)
    if num_calls is not None and len(responses) != num_calls:
        problems.append(f"{num_calls} tool calls but {len(responses)} tool responses")
    return responses, ("; ".join(problems) if problems else None)
