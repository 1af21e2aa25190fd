"""Forced tool calls (`tool_choice` 'required' or a named function) over real HTTP on 127.0.0.1,
with a model that knows nothing of the tools (the planted test model's random weights): the
call's JSON is decoded under the tool's schema, so a finished call always parses, and a call
that the token budget cuts short is a 200 with finish_reason 'length', never a 500."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.serve_helpers import chat, export_test_model, running_server

PLAN = {
    "type": "function",
    "function": {
        "name": "plan_days",
        "description": "Plan a few days out",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "outdoor": {"type": "boolean"},
            },
            "required": ["unit", "days", "outdoor"],
            "additionalProperties": False,
        },
    },
}
# Names no single token completes: one token of a reply cannot finish a call of either.
LONG_NAMES = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("lookup_the_weather_forecast", "reserve_a_restaurant_table")
]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("forced") / "tiny-qwen3")
    export_test_model(model_dir)
    with running_server(model_dir) as (url, _), httpx.Client(base_url=url, timeout=300) as c:
        yield c


def _events(resp) -> list[dict]:
    lines = [line[len("data: ") :] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", resp.text
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "plan_days"}}]
)
def test_a_forced_call_of_a_non_strict_function_has_arguments_valid_for_its_schema(
    http, tool_choice
):
    """Random weights write no call of their own: the schema's grammar writes it (a 500
    'forces a tool call, but the reply is not a JSON object' before)."""
    body = chat("Plan.", tools=[PLAN], tool_choice=tool_choice, n=3, max_tokens=48)
    resp = http.post("/v1/chat/completions", json={**body, "temperature": 1.0})
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "plan_days"
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), PLAN["function"]["parameters"]
        )


def test_a_forced_call_of_an_any_object_tool_is_a_call_or_a_length_reply(http):
    """A 500 'model_error' before (was `test_serve_hostile`'s): the random reply to a forced
    call of a tool with no declared arguments."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    body = chat("Weather?", tools=[tool], tool_choice="required", max_tokens=8, temperature=0)
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    calls = choice["message"].get("tool_calls")
    if calls:
        (call,) = calls
        assert call["function"]["name"] == "lookup"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    else:
        assert choice["finish_reason"] == "length", choice


def test_a_forced_call_cut_short_by_max_tokens_is_a_length_reply_not_a_500(http):
    body = chat("Weather?", tools=LONG_NAMES, tool_choice="required", n=2, max_tokens=1)
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        assert choice["finish_reason"] == "length", choice
        message = choice["message"]
        assert message["role"] == "assistant" and not message.get("tool_calls"), message
        assert message["content"].startswith("<tool_call>"), message


def test_a_streamed_forced_call_cut_short_ends_with_length_and_no_error_event(http):
    body = chat("Weather?", tools=LONG_NAMES, tool_choice="required", max_tokens=1, stream=True)
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    events = _events(resp)
    assert not [e for e in events if "error" in e], events
    assert events[-1]["choices"][0]["finish_reason"] == "length", events
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert content.startswith("<tool_call>"), events
