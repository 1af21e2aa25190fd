"""Structured output (`serve.structured`): `response_format` json_schema / json_object enforced
while decoding, against `python -m envace_jax.serve` serving the shipped demo policy.

Every sampled reply (temperature 1) must parse and validate against its schema, checked by an
independent validator (`jsonschema`); bad schemas are 400s that name the field; the LLM judge
(`rewards.llm_judge`, strict json_schema by default) gets a verdict from every request; and
requests without a `response_format` never decode under a mask.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json

import httpx
import jsonschema
import numpy as np
import pytest

from envace_jax.models.shipped import DEMO_BASE_DIR
from envace_jax.rewards.llm_judge import VERDICT_SCHEMA
from tests.serve_helpers import error_of, running_server

MODEL = "demo-base"
SCHEMA = "response_format.json_schema.schema"

# The judge's verdict with bounded strings: every reply completes well within max_tokens.
VERDICT_BOUNDED = copy.deepcopy(VERDICT_SCHEMA)
for _prop in VERDICT_BOUNDED["properties"].values():
    if _prop["type"] == "string":
        _prop["maxLength"] = 40
NESTED = {
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "error", "pending"]},
        "order": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "city": {"type": "string", "maxLength": 20},
                "items": {
                    "type": "array",
                    "items": {"enum": ["umbrella", "lamp", "chair"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "gift": {"type": "boolean"},
            },
            "required": ["id", "city", "items"],
            "additionalProperties": False,
        },
        "refund": {"type": ["integer", "null"], "minimum": 0, "maximum": 1000},
    },
    "required": ["status", "order", "refund"],
    "additionalProperties": False,
}


def _schema_format(schema, name="reply"):
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


def _body(content, response_format=None, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}
    if response_format is not None:
        body["response_format"] = response_format
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port_file = str(tmp_path_factory.mktemp("structured") / "port")
    extra = ["--tokenizer", "demo", "--served-model-name", MODEL, "--max-batch", "32"]
    with running_server(DEMO_BASE_DIR, *extra, port_file=port_file) as (url, _):
        yield url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=300) as client:
        yield client


def _post(http, body):
    return http.post("/v1/chat/completions", json=body)


def test_mask_unpacks_bit_j_of_word_i_as_token_32i_plus_j():
    import jax.numpy as jnp

    from envace_jax.sampling.loop import apply_token_mask

    rng = np.random.default_rng(0)
    allowed = rng.random((3, 70)) < 0.3  # V = 70: three words, the last one partly used
    words = np.zeros((3, 3), np.uint32)
    for row, token in zip(*np.nonzero(allowed), strict=True):
        words[row, token // 32] |= np.uint32(1) << np.uint32(token % 32)
    words = words.view(np.int32)
    logits = jnp.asarray(rng.normal(size=(3, 70)), jnp.float32)
    masked = np.asarray(apply_token_mask(logits, jnp.asarray(words)))
    np.testing.assert_array_equal(masked > -1e29, allowed)
    np.testing.assert_array_equal(masked[allowed], np.asarray(logits)[allowed])


def test_sampled_replies_all_parse_and_validate(http):
    """100 replies sampled at temperature 1 (40 judge verdicts; 20 requests x n=3 of a nested
    schema with enums, a boolean, a nullable integer and required fields): all valid."""
    jobs = [
        (VERDICT_BOUNDED, _body(f"Judge {i}.", _schema_format(VERDICT_BOUNDED), n=1))
        for i in range(40)
    ]
    jobs += [
        (NESTED, _body(f"Order {i}?", _schema_format(NESTED, "order"), n=3)) for i in range(20)
    ]
    for _, body in jobs:
        body.update(temperature=1.0, max_tokens=400)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        resps = list(pool.map(lambda job: _post(http, job[1]), jobs))
    replies = failures = 0
    for (schema, _), resp in zip(jobs, resps, strict=True):
        assert resp.status_code == 200, resp.text
        for choice in resp.json()["choices"]:
            replies += 1
            content = choice["message"]["content"]
            try:
                assert choice["finish_reason"] == "stop"
                assert "tool_calls" not in choice["message"]
                jsonschema.validate(json.loads(content), schema)
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                failures += 1
                print(f"invalid reply ({choice['finish_reason']}): {content!r}: {e}")
    assert replies == 100 and failures == 0, f"{failures} of {replies} replies invalid"


def test_json_object_is_an_object(http):
    greedy = _body("Hello", {"type": "json_object"}, temperature=0.0, max_tokens=120)
    choice = _post(http, greedy).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    # Sampled: free-form JSON may outrun max_tokens ('length', a prefix of an object);
    # every reply that ends by itself is an object.
    sampled = _body("Hello", {"type": "json_object"}, temperature=1.0, max_tokens=120, n=4)
    choices = _post(http, sampled).json()["choices"]
    for choice in choices:
        assert choice["message"]["content"].startswith("{"), choice
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            assert choice["finish_reason"] == "length"


def test_streamed_reply_validates(http):
    body = _body("Order 7?", _schema_format(NESTED), stream=True, max_tokens=400)
    text, reasons = [], []
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text.append(choice["delta"].get("content") or "")
                reasons.append(choice["finish_reason"])
    assert [r for r in reasons if r] == ["stop"]
    jsonschema.validate(json.loads("".join(text)), NESTED)


def test_length_ends_a_reply_before_its_json_is_complete(http):
    endless = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
    resp = _post(http, _body("Judge.", _schema_format(endless), max_tokens=100))
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert resp.json()["usage"]["completion_tokens"] == 100
    assert choice["message"]["content"].startswith("[")


@pytest.mark.parametrize(
    "response_format, param",
    [
        ({"type": "json_schema", "json_schema": {"name": "x"}}, SCHEMA),
        (_schema_format([1, 2]), SCHEMA),
        (_schema_format("object"), SCHEMA),
        (_schema_format({"type": "wizard"}), SCHEMA),
        (_schema_format({"not": {"type": "string"}}), SCHEMA),
        (_schema_format({"$ref": "#/$defs/missing"}), SCHEMA),
        (_schema_format({"type": "string", "pattern": "[a-"}), SCHEMA),
        (
            _schema_format({"type": "array", "minItems": 3, "maxItems": 1}),
            SCHEMA,
        ),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_object", "json_schema": {"schema": {}}}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ("json", "response_format"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_the_field(http, response_format, param):
    resp = _post(http, _body("hi", response_format, max_tokens=4))
    err = error_of(resp, 400)
    assert err["param"].startswith(param) and param in err["message"], err


def test_a_forced_tool_call_and_a_response_format_are_a_400(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = _body("hi", {"type": "json_object"}, tools=[tool], tool_choice="required")
    err = error_of(_post(http, {**body, "max_tokens": 4}), 400)
    assert err["param"] == "response_format"


STRICT_TOOL = {
    "type": "function",
    "function": {
        "name": "book_trip",
        "description": "Book a hotel stay",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "nights": {"type": "integer", "minimum": 1, "maximum": 14},
                "class": {"enum": ["economy", "business"]},
                "pets": {"type": "boolean"},
            },
            "required": ["city", "nights", "class", "pets"],
            "additionalProperties": False,
        },
    },
}


def test_a_forced_call_of_a_strict_function_has_valid_arguments(http):
    """Strict function calling: the forced call's arguments are decoded under the schema."""
    named = {"type": "function", "function": {"name": "book_trip"}}
    body = _body("Book a trip.", tools=[STRICT_TOOL], tool_choice=named, n=4, max_tokens=120)
    resp = _post(http, {**body, "temperature": 1.0})
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "book_trip"
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, STRICT_TOOL["function"]["parameters"])


def test_a_strict_function_with_a_bad_schema_is_a_400(http):
    bad = copy.deepcopy(STRICT_TOOL)
    bad["function"]["parameters"]["properties"]["nights"] = {"type": "wizard"}
    body = _body("Book.", tools=[bad], tool_choice="required", max_tokens=8)
    err = error_of(_post(http, body), 400)
    assert err["param"] == "tools[0].function.parameters", err


def test_unconstrained_requests_decode_without_masks(http):
    def masked_steps():
        return http.get("/health").json()["engine"].get("masked_steps", 0)

    before = masked_steps()
    plain = _body("Hello", max_tokens=24, temperature=1.0, n=4)
    resp = _post(http, plain)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 4
    assert masked_steps() == before
    # Sharing a batch with constrained rows, plain replies are still free text.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, http, plain)]
        futures += [
            pool.submit(_post, http, _body("x", _schema_format(NESTED), max_tokens=300))
            for _ in range(3)
        ]
        resps = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in resps)
    for r in resps[1:]:
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), NESTED)
    assert masked_steps() > before


def test_the_llm_judge_gets_a_verdict_from_every_request(server):
    from envace_jax.data import ChecklistItem
    from envace_jax.rewards.llm_judge import JudgeConfig, LLMJudge

    messages = [
        {"role": "user", "content": "What is the status of order 1042?"},
        {"role": "assistant", "content": "Order 1042 has shipped."},
    ]
    items = [
        ChecklistItem(
            question=f"Does the reply give the order's status? ({i})",
            focus_on="assistant.content",
            pass_condition="the reply says the order has shipped",
            failure_examples=("No status",),
            evidence=("has shipped",),
            weight=1.0,
            required_for_next_turn=False,
        )
        for i in range(1)
    ]
    config = JudgeConfig(
        base_url=server + "/v1", model=MODEL, max_tokens=1024, max_retries=0, trust_env=False
    )
    assert config.response_format  # the default: strict json_schema
    with LLMJudge(config) as judge:
        got = judge.judge_turn(messages, items)
    m = got.metrics
    assert m["judge_requests"] == 1
    assert m["judge_malformed"] == 0 and m["judge_http_errors"] == 0, m
    assert m["judge_failures"] == 0 and not got.judge_failed, m


class _Refuses:
    """A grammar that allows everything and then refuses the token sampled."""

    def __init__(self, words):
        self.words = words

    def fill_mask(self, out):
        out[:] = -1

    def advance(self, ids):
        return f"refused {ids}"


class _Breaks(_Refuses):
    """A grammar whose mask cannot be computed."""

    def fill_mask(self, out):
        raise RuntimeError("no mask")


def test_a_broken_grammar_fails_its_own_sequence_only():
    """In one batch: two rows whose grammars break end with an error; a constrained row and a
    free one beside them finish as usual."""
    import threading

    from envace_jax.serve.__main__ import build_server, parse_args
    from envace_jax.serve.sequences import Done, Sequence, Tokens
    from envace_jax.text.chat import encode, render_text

    args = parse_args(["--model", DEMO_BASE_DIR, "--tokenizer", "demo", "--max-batch", "4"])
    state = build_server(args)[0].server_state
    engine, structured, tok = state.engine, state.structured, state.tokenizer
    prompt = encode(tok, render_text(tok, [{"role": "user", "content": "Order 1?"}], None, True))
    words = structured.words
    grammars = [_Refuses(words), _Breaks(words), structured.compile_schema(NESTED, "s").new(), None]
    events = [[] for _ in grammars]
    done = threading.Semaphore(0)

    def on_event(i):
        def record(ev):
            events[i].append(ev)
            if isinstance(ev, Done):
                done.release()

        return record

    engine.start()
    try:
        for i, grammar in enumerate(grammars):
            seq = Sequence(tuple(prompt), 150, _sampling(), on_event(i))
            seq.grammar = grammar
            engine.submit(seq)
        for _ in grammars:
            assert done.acquire(timeout=120)
    finally:
        engine.stop()
    ends = [ev[-1] for ev in events]
    assert [e.finish_reason for e in ends[:2]] == ["error", "error"], ends
    assert "refused" in ends[0].error and "no mask" in ends[1].error
    assert ends[2].finish_reason == "stop" and ends[3].finish_reason in ("stop", "length")
    ids = [t for ev in events[2] if isinstance(ev, Tokens) for t in ev.ids]
    jsonschema.validate(json.loads(tok.decode(ids)), NESTED)


def _sampling():
    from envace_jax.sampling.distributions import SamplingParams

    return SamplingParams(temperature=1.0)
