"""Tool-call parsing, schema validation, formatting, tool-response splitting, sanitisation."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace_jax.text import (
    ErrorCode,
    ParsedAction,
    ToolCall,
    encode,
    format_action,
    format_tool_calls,
    load_tokenizer,
    parse_tool_calls,
    parse_tool_responses,
    render_text,
    sanitize_json,
    sanitize_text,
    validate_schema,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "transfer",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number"},
                    "count": {"type": "integer"},
                    "to": {"type": "string"},
                    "urgent": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "meta": {"type": "object"},
                    "currency": {"type": "string", "enum": ["USD", "EUR"]},
                },
                "required": ["amount", "to"],
                "additionalProperties": False,
            },
        },
    },
    {"name": "ping", "parameters": {"type": "object", "properties": {}}},  # bare form
]


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_final_reply_has_no_error_and_no_calls():
    action = parse_tool_calls("Your balance is $12.50.")
    assert action == ParsedAction("Your balance is $12.50.", (), None)
    assert action.is_final_reply and action.code is ErrorCode.NO_TOOL_CALL


def test_one_call_with_content():
    text = 'Let me check.\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    action = parse_tool_calls(text, TOOLS)
    assert action.error is None and not action.is_final_reply and action.code is None
    assert action.content == "Let me check."
    assert action.calls == (ToolCall("ping", {}, '{"name": "ping", "arguments": {}}'),)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "ping", "arguments": {"a": 1}}</tool_call>',
        '<tool_call>\n{"name": "ping", "arguments": {"a": 1}}\n</tool_call>',
        '<tool_call>  \n {"name": "ping", "parameters": {"a": 1}} \n\n</tool_call>',
        '<tool_call>{"name": " ping ", "arguments": "{\\"a\\": 1}"}</tool_call>',
    ],
)
def test_block_spacing_parameters_alias_and_string_arguments(text):
    action = parse_tool_calls(text)
    assert action.error is None
    assert [(c.name, c.arguments) for c in action.calls] == [("ping", {"a": 1})]
    assert action.content == ""


def test_several_blocks_and_a_list_in_one_block():
    text = (
        "x\n"
        + block('{"name": "a", "arguments": {"k": [1, 2]}}')
        + "\n"
        + block('[{"name": "b", "arguments": {}}, {"name": "c", "parameters": {"z": null}}]')
    )
    action = parse_tool_calls(text)
    assert action.error is None and action.content == "x"
    assert [(c.name, c.arguments) for c in action.calls] == [
        ("a", {"k": [1, 2]}),
        ("b", {}),
        ("c", {"z": None}),
    ]


@pytest.mark.parametrize(
    "text, code, fragment",
    [
        ('<tool_call>\n{"name": "a", "arguments": {}}', ErrorCode.UNCLOSED_BLOCK, "block 1"),
        (
            block('{"name": "a", "arguments": {}}') + "<tool_call>{",
            ErrorCode.UNCLOSED_BLOCK,
            "block 2",
        ),
        (
            '<tool_call>{"name": "a"<tool_call>{"name": "b", "arguments": {}}</tool_call>',
            ErrorCode.UNCLOSED_BLOCK,
            "block 1",
        ),
        (block('{"name": "a", "arguments": {}'), ErrorCode.JSON_DECODE_ERROR, "block 1"),
        (block(""), ErrorCode.JSON_DECODE_ERROR, "not valid JSON"),
        (block('{"name": "a", "arguments": {"x": NaN}}'), ErrorCode.JSON_DECODE_ERROR, "NaN"),
        (block("[]"), ErrorCode.INVALID_CALL, "empty list"),
        (block('"ping"'), ErrorCode.INVALID_CALL, "string"),
        (block('[{"name": "a", "arguments": {}}, 3]'), ErrorCode.INVALID_CALL, "call 2"),
        (block('{"arguments": {}}'), ErrorCode.MISSING_NAME, "name"),
        (block('{"name": "  ", "arguments": {}}'), ErrorCode.MISSING_NAME, "name"),
        (block('{"name": 7, "arguments": {}}'), ErrorCode.MISSING_NAME, "name"),
        (block('{"name": "a"}'), ErrorCode.MISSING_ARGUMENTS, "(a)"),
        (block('{"name": "a", "arguments": null}'), ErrorCode.MISSING_ARGUMENTS, "arguments"),
        (block('{"name": "a", "arguments": [1]}'), ErrorCode.NON_DICT_ARGUMENTS, "array"),
        (block('{"name": "a", "arguments": "x=1"}'), ErrorCode.NON_DICT_ARGUMENTS, "string"),
    ],
)
def test_error_codes(text, code, fragment):
    action = parse_tool_calls(text)
    assert action.error is not None and action.error.code is code
    assert fragment in action.error.message
    assert action.calls == () and not action.is_final_reply and action.code is code


def test_one_bad_block_invalidates_all_calls():
    good = block('{"name": "ping", "arguments": {}}')
    action = parse_tool_calls(good + "\n" + block('{"name": "ping"}') + "\n" + good)
    assert action.calls == () and action.error.code is ErrorCode.MISSING_ARGUMENTS


def test_unknown_tool():
    action = parse_tool_calls(block('{"name": "rob_bank", "arguments": {}}'), TOOLS)
    assert action.error.code is ErrorCode.UNKNOWN_TOOL
    assert "rob_bank" in action.error.message and "transfer" in action.error.message


@pytest.mark.parametrize(
    "args, fragment",
    [
        ({"to": "bob"}, "missing required property 'amount'"),
        ({"amount": "12", "to": "bob"}, "arguments.amount: expected number, got string"),
        ({"amount": True, "to": "bob"}, "arguments.amount: expected number, got boolean"),
        ({"amount": 1, "to": 5}, "arguments.to: expected string, got integer"),
        ({"amount": 1, "to": "b", "count": 1.5}, "arguments.count: expected integer"),
        ({"amount": 1, "to": "b", "count": False}, "arguments.count: expected integer"),
        ({"amount": 1, "to": "b", "urgent": 1}, "arguments.urgent: expected boolean"),
        ({"amount": 1, "to": "b", "tags": "x"}, "arguments.tags: expected array"),
        ({"amount": 1, "to": "b", "tags": ["x", 2]}, "arguments.tags[1]: expected string"),
        ({"amount": 1, "to": "b", "meta": []}, "arguments.meta: expected object"),
        ({"amount": 1, "to": "b", "currency": "GBP"}, "arguments.currency"),
        ({"amount": 1, "to": "b", "memo": "rent"}, "unexpected property 'memo'"),
    ],
)
def test_schema_mismatch(args, fragment):
    text = block(json.dumps({"name": "transfer", "arguments": args}))
    action = parse_tool_calls(text, TOOLS)
    assert action.error is not None and action.error.code is ErrorCode.SCHEMA_MISMATCH
    assert fragment in action.error.message
    assert "call 1 (transfer)" in action.error.message


def test_schema_accepts_valid_arguments():
    args = {
        "amount": 3,  # an integer is a number
        "to": "bob",
        "count": 2.0,  # a number with zero fraction is an integer (JSON Schema)
        "urgent": False,
        "tags": [],
        "meta": {"anything": [1, {"x": None}]},
        "currency": "EUR",
    }
    action = parse_tool_calls(block(json.dumps({"name": "transfer", "arguments": args})), TOOLS)
    assert action.error is None and action.calls[0].arguments == args


@pytest.mark.parametrize(
    "value, schema, ok",
    [
        (None, {"type": ["string", "null"]}, True),
        (1, {"type": ["string", "null"]}, False),
        (True, {"enum": [1, 2]}, False),  # true is not 1 in JSON
        (1, {"enum": [1, 2]}, True),
        ("a", {"const": "a"}, True),
        ("b", {"const": "a"}, False),
        (5, {"type": "integer", "minimum": 1, "maximum": 4}, False),
        (0, {"type": "integer", "minimum": 1}, False),
        ("abc", {"type": "string", "maxLength": 2}, False),
        ([1, 2, 3], {"type": "array", "maxItems": 2}, False),
        ({"a": 1, "b": "x"}, {"additionalProperties": {"type": "integer"}}, False),
        ({"a": 1}, {"additionalProperties": {"type": "integer"}}, True),
        ("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, True),
        ([], {"anyOf": [{"type": "integer"}, {"type": "string"}]}, False),
        (
            {"a": {"b": [{"c": 1}]}},
            {
                "properties": {
                    "a": {"properties": {"b": {"items": {"properties": {"c": {"type": "string"}}}}}}
                }
            },
            False,
        ),
        ("anything", {"type": "uuid-ish"}, True),  # unknown types are not rejected
    ],
)
def test_validator_against_json_schema_semantics(value, schema, ok):
    assert (validate_schema(value, schema) is None) == ok


def test_bad_tools_list_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tools\[1\]"):
        parse_tool_calls("hi", [TOOLS[0], {"function": {"description": "no name"}}])


# ---------------------------------------------------------------------------------------------
# Never raises


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "\n",
    " ",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"parameters"',
    ":",
    ",",
    '"ping"',
    '"transfer"',
    '"amount"',
    "1",
    "-2.5e3",
    "null",
    "true",
    '"\\ud800"',
    "NaN",
    "Infinity",
    '"',
    "\\",
    "<tool_response>",
    "<|im_end|>",
    "\x00",
    "\ud800",
    "\ufffe",
    "x" * 3,
    "[[[[[[[[",
    "{}",
    '{"to": "b"}',
]


def _check_invariants(action: ParsedAction, text: str) -> None:
    assert isinstance(action, ParsedAction)
    if action.error is not None:
        assert action.calls == ()
        assert isinstance(action.error.code, ErrorCode) and action.error.message
    if "<tool_call>" not in text:
        assert action.is_final_reply
    for call in action.calls:
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_arbitrary_text_never_raises(text):
    _check_invariants(parse_tool_calls(text), text)
    _check_invariants(parse_tool_calls(text, TOOLS), text)
    responses, _ = parse_tool_responses(text, num_calls=2)
    assert isinstance(responses, list)


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join))
def test_fuzz_fragment_text_never_raises(text):
    _check_invariants(parse_tool_calls(text), text)
    _check_invariants(parse_tool_calls(text, TOOLS), text)
    parse_tool_responses(text, num_calls=1)


def test_deep_nesting_does_not_raise():
    text = block("[" * 100_000 + "]" * 100_000)
    assert parse_tool_calls(text).error.code is ErrorCode.JSON_DECODE_ERROR
    deep = '{"name": "transfer", "arguments": {"amount": 1, "to": "b", "meta": ' + (
        '{"a": ' * 5000 + "1" + "}" * 5000 + "}}"
    )
    parse_tool_calls(block(deep), TOOLS)  # either error, never an exception


# ---------------------------------------------------------------------------------------------
# Formatting against the template, and the parse round trip

json_scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
calls = st.lists(
    st.tuples(names, st.dictionaries(st.text(max_size=6), json_values, max_size=4)),
    min_size=1,
    max_size=3,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


def test_format_matches_qwen3_layout_by_hand():
    got = format_action(
        "ok", [{"name": "f", "arguments": {"a": "é", "b": [1, 2.5]}}, ToolCall("g", {}, "")]
    )
    assert got == (
        'ok\n<tool_call>\n{"name": "f", "arguments": {"a": "é", "b": [1, 2.5]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    assert format_action("", [{"function": {"name": "f", "arguments": '{"x":1}'}}]) == (
        '<tool_call>\n{"name": "f", "arguments": {"x":1}}\n</tool_call>'
    )
    assert format_action("bye") == "bye"


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=20).filter(lambda s: "<" not in s), calls)
def test_format_equals_template_rendering_and_parses_back(tok, content, call_list):
    openai = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in call_list]
    user = {"role": "user", "content": "q"}
    before = render_text(tok, [user], add_generation_prompt=True)
    rendered = render_text(
        tok, [user, {"role": "assistant", "content": content, "tool_calls": openai}]
    )
    assert rendered == before + format_action(content, openai) + "<|im_end|>\n"
    assert format_tool_calls(openai) == format_action("", openai)
    action = parse_tool_calls(format_action(content, openai))
    assert action.error is None
    assert action.content == sanitize_text(content)  # the separating newline is not content
    assert [(c.name, c.arguments) for c in action.calls] == [
        (n, sanitize_json(a)) for n, a in call_list
    ]


# ---------------------------------------------------------------------------------------------
# Tool responses


def test_responses_of_a_rehearse_span_and_of_a_whole_turn():
    span = 'A\n</tool_response>\n<tool_response>\n{"b": 2}\n</tool_response><|im_end|>'
    assert parse_tool_responses(span, 2) == (["A", '{"b": 2}'], None)
    turn = "<|im_start|>user\n<tool_response>\n" + span + "\n"
    assert parse_tool_responses(turn, 2) == (["A", '{"b": 2}'], None)
    assert parse_tool_responses("\n\nx\n\n</tool_response><|im_end|>") == (["\n\nx\n"], None)


def test_response_problems_are_reported():
    span = "A\n</tool_response><|im_end|>"
    responses, problem = parse_tool_responses(span, 2)
    assert responses == ["A"] and problem == "2 tool calls but 1 tool responses"
    responses, problem = parse_tool_responses("only text<|im_end|>", 1)
    assert responses == ["only text"] and "not closed" in problem
    responses, problem = parse_tool_responses("A\n</tool_response>\nB\n</tool_response>", 2)
    assert responses == ["A", "\nB"] and "response 2 does not start" in problem
    responses, problem = parse_tool_responses("A\n</tool_response> trailing", 1)
    assert "text after the last" in problem


def test_responses_from_ids(tok):
    span = "A\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>"
    assert parse_tool_responses(encode(tok, span), 2, tokenizer=tok) == (["A", "B"], None)
    with pytest.raises(ValueError, match="tokenizer"):
        parse_tool_responses([1, 2, 3])


# ---------------------------------------------------------------------------------------------
# Sanitisation


@pytest.mark.parametrize(
    "ch",
    [
        "\ud800",
        "\udfff",
        "\x00",
        "\ufdd0",
        "\ufdef",
        "\ufffe",
        "\uffff",
        "\U0001fffe",
        "\U0010ffff",
    ],
)
def test_sanitize_replaces_code_points_the_tokenizer_refuses(ch):
    assert sanitize_text(f"a{ch}b") == "a\ufffdb"
    assert sanitize_json({f"k{ch}": [ch, 1, {"x": ch}]}) == {
        "k\ufffd": ["\ufffd", 1, {"x": "\ufffd"}]
    }


def test_sanitize_keeps_ordinary_text():
    text = "naïve café – 日本語 \ufffd \ufdcf \ufdf0 \U0001f600"
    assert sanitize_text(text) is text


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=50))
def test_sanitized_text_always_encodes(tok, text):
    encode(tok, sanitize_text(text))


def test_parser_sanitises_content_and_arguments():
    text = "hi\ud800\n" + block('{"name": "ping", "arguments": {"s": "\\ud800x"}}')
    action = parse_tool_calls(text)
    assert action.content == "hi\ufffd"
    assert action.calls[0].arguments == {"s": "\ufffdx"}
