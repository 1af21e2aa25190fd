"""LLM judge against a real HTTP server on 127.0.0.1 that decides verdicts by a rule.

The server passes an item iff the LAST assistant step of the prompt's current messages
contains the item's marker word, and misbehaves on request: tags in the item's question make
it answer slowly (past the client's timeout), fail with HTTP 500 once per prompt, return
malformed bodies, or wrap the verdict in a fence, prose or a think block.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from envace_jax.data import ChecklistItem
from envace_jax.rewards.checklist import aggregate
from envace_jax.rewards.judge_prompt import parse_verdict, render_messages
from envace_jax.rewards.llm_judge import JudgeConfig, LLMJudge

# A prompt-rendering or scheduling stall on a loaded 2-core machine once took a fast answer
# past a 0.3 s timeout; 2 s leaves room while a slow answer still times out every time.
SLOW_S = 4.0
TIMEOUT_S = 2.0


class JudgeServer:
    def __init__(self, api_key: str | None = None):
        self.api_key = api_key
        self.lock = threading.Lock()
        self.seen: collections.Counter = collections.Counter()  # prompt -> requests
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                try:
                    server.handle(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    @staticmethod
    def verdict(prompt: str) -> bool:
        marker = re.search(r"\[marker=(\w+)\]", prompt).group(1)
        current = prompt.split("# Current Messages to Evaluate\n", 1)[1]
        current = current.split("# Rules about tool calls", 1)[0]
        last_step = current.rsplit("## Step:", 1)[1]
        return marker in last_step

    def handle(self, h: BaseHTTPRequestHandler):
        if h.path != "/v1/chat/completions":
            return self.send(h, 404, b"{}")
        body = json.loads(h.rfile.read(int(h.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        with self.lock:
            self.bodies.append(body)
            self.seen[prompt] += 1
            nth = self.seen[prompt]
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        released = False

        def respond(code: int, payload: bytes):
            # The request leaves the in-flight count before its reply is written: once the client
            # reads the reply it may send the next request, which must not count twice.
            nonlocal released
            with self.lock:
                self.in_flight -= 1
                released = True
            return self.send(h, code, payload)

        try:
            if self.api_key and h.headers.get("Authorization") != f"Bearer {self.api_key}":
                return respond(401, b'{"error": "bad key"}')
            question = re.search(r"\*\*Question:\*\* (.*)\n", prompt).group(1)
            if "[no-schema]" in question and "response_format" in body:
                error = {"error": {"message": "response_format: only {'type': 'text'}"}}
                return respond(400, json.dumps(error).encode())
            answer = self.verdict(prompt)
            verdict = {
                "high_level_understanding_of_the_question": "u",
                "analysis_of_if_focus_on": "f",
                "analysis_of_pass_condition": "p",
                "analysis_of_failure_examples": "e",
                "answer": answer,
            }
            content = json.dumps(verdict)
            if "[pace]" in question:
                time.sleep(0.05)
            if "[slow]" in question or ("[slow-once]" in question and nth == 1):
                time.sleep(SLOW_S)
            if "[flaky]" in question and nth == 1:
                return respond(500, b"internal error")
            if "[garbage]" in question:
                return respond(200, b"<html>not json</html>")
            if "[no-answer]" in question:
                content = "I think it is fine."
            if "[fenced]" in question:
                content = f"Here is my verdict:\n```json\n{content}\n```\n"
            if "[trailing]" in question:
                content = f"The step was checked carefully.\nanswer: {str(answer).lower()}"
            if "[think]" in question:
                content = f'<think>maybe "answer": {json.dumps(not answer)}</think>\n{content}'
            reply = {"choices": [{"message": {"role": "assistant", "content": content}}]}
            return respond(200, json.dumps(reply).encode())
        finally:
            with self.lock:
                self.in_flight -= 0 if released else 1

    @staticmethod
    def send(h, code: int, payload: bytes):
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def judge_config(base_url: str, **kw) -> JudgeConfig:
    defaults = dict(
        model="judge-model",
        temperature=0.6,
        max_tokens=512,
        timeout_s=TIMEOUT_S,
        max_retries=2,
        backoff_s=0.01,
        concurrency=8,
        trust_env=False,  # loopback never goes through a proxy
    )
    defaults.update(kw)
    return JudgeConfig(base_url=base_url, **defaults)


def item(
    marker: str,
    tags: str = "",
    weight: float = 0.1,
    focus: str = "assistant.content.user_visible_reply",
):
    return ChecklistItem(
        question=f"Does the step mention it? [marker={marker}] {tags}",
        focus_on=focus,
        pass_condition="The marker word appears in the step.",
        failure_examples=("The marker is missing",),
        evidence=("a reference snippet",),
        weight=weight,
        required_for_next_turn=False,
    )


CALL = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
CONVERSATION = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "First question PEAR?"},
    {"role": "assistant", "content": "First answer."},
    {"role": "user", "content": "Second question."},
    {"role": "assistant", "content": "<think>consider MANGO</think>", "tool_calls": [CALL]},
    {"role": "tool", "name": "lookup", "content": '{"result": 1}'},
    {"role": "assistant", "content": "<think>done</think>\n\nThe answer is KIWI."},
]

F, T = False, True
# (item, expected verdict at step 0, expected at step 1, fails)
CASES = [
    (item("KIWI", weight=0.3), F, T, False),
    (item("MANGO", "[flaky]", weight=0.2), T, F, False),
    (item("KIWI", "[slow]", weight=0.1), F, F, True),
    (item("KIWI", "[garbage]", weight=0.1), F, F, True),
    (item("KIWI", "[fenced]", weight=0.2), F, T, False),
    (item("MANGO", "[trailing]", weight=0.05), T, F, False),
    (item("KIWI", "[think]", weight=0.05), F, T, False),
]


def test_verdicts_retries_timeouts_and_failures_are_counted(server):
    items = [c[0] for c in CASES]
    with LLMJudge(judge_config(server.base_url)) as judge:
        out = judge.judge_turn(CONVERSATION, items)
    assert out.verdicts == [[c[1] for c in CASES], [c[2] for c in CASES]]
    assert out.failed == [[c[3] for c in CASES]] * 2
    assert out.judge_failed
    # Per step: plain 1 request, flaky 2 (500 then success), slow 3 (all time out), garbage 3
    # (all malformed), fenced / trailing / think 1 each. Two steps.
    assert out.metrics == {
        "judge_items": 14,
        "judge_short_circuit": 0,
        "judge_requests": 2 * (1 + 2 + 3 + 3 + 1 + 1 + 1),
        "judge_retries": 2 * (1 + 2 + 2),
        "judge_timeouts": 2 * 3,
        "judge_http_errors": 2 * 1,
        "judge_malformed": 2 * 3,
        "judge_failures": 2 * 2,
        "judge_text_fallback": 0,
    }
    # Into the reward: this is the last of two user turns; turn 0 passed its only item.
    checklist = [[item("PEAR", weight=1.0)], items]
    score = aggregate(checklist, [[[True]], out.verdicts], judge_failures=[False, out.judge_failed])
    # Passed: plain 0.3 + flaky 0.2 + fenced 0.2 + trailing 0.05 + think 0.05 = 0.8.
    assert score.per_turn == pytest.approx((1.0, 0.8))
    assert score.score == pytest.approx(0.9)
    assert score.ended_early_reason is None


def test_retry_after_slow_or_malformed_first_answer(server):
    items = [item("KIWI", "[slow-once]"), item("KIWI", "[no-answer]")]
    with LLMJudge(judge_config(server.base_url, max_retries=1)) as judge:
        out = judge.judge_turn(CONVERSATION[:4] + [CONVERSATION[6]], items)
    assert out.verdicts == [[True, False]]
    assert out.failed == [[False, True]]
    m = out.metrics
    assert (m["judge_requests"], m["judge_retries"], m["judge_timeouts"]) == (4, 2, 1)
    assert (m["judge_malformed"], m["judge_failures"]) == (2, 1)


def test_request_carries_the_reference_prompt_structure(server):
    it = ChecklistItem(
        question="Was the lookup made? [marker=MANGO]",
        focus_on="assistant.tool_calls",
        pass_condition="lookup is called with q=x",
        failure_examples=("No call", "Wrong q"),
        evidence=('"name": "lookup"',),
        weight=1.0,
        required_for_next_turn=True,
    )
    cfg = judge_config(server.base_url, max_retries=0)
    with LLMJudge(cfg) as judge:
        judge.judge_turn(CONVERSATION[:6], [it])
    (body,) = server.bodies
    assert body["model"] == "judge-model"
    assert body["temperature"] == 0.6 and body["max_tokens"] == 512 and body["top_p"] == 0.8
    schema = body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["answer"] == {"type": "boolean"}
    prompt = body["messages"][0]["content"]
    for text in (
        "**Question:** Was the lookup made? [marker=MANGO]",
        "**Focus on:** assistant.tool_calls",
        "**Pass condition:** lookup is called with q=x",
        '"Wrong q"',
        '"\\"name\\": \\"lookup\\""',
    ):
        assert text in prompt
    previous, current = prompt.split("# Previous Messages\n")[1].split(
        "# Current Messages to Evaluate\n"
    )
    assert (
        "Role: system\ncontent: You help.\n# Turn: 0\nRole: user\ncontent: First question PEAR?"
        in previous
    )
    assert "Second question" not in previous
    assert current.startswith("# Turn: 1\nRole: user\ncontent: Second question.\n## Step: 0\n")
    assert "content.thinking: consider MANGO\ncontent.user_visible_reply: None\n" in current
    assert 'tool_call: [{"id": "c0", "type": "function"' in current
    assert 'Role: tool\ncontent: {"result": 1}' in current


def test_tool_error_short_circuits_tool_items(server):
    convo = CONVERSATION[:5] + [
        {"role": "tool", "content": '{"error_tool_call": {"code": "INVALID_PARAMETERS"}}'},
        CONVERSATION[6],
    ]
    items = [
        item("MANGO", focus="assistant.tool_calls"),
        item("MANGO", focus="tool.content"),
        item("MANGO"),
    ]
    with LLMJudge(judge_config(server.base_url)) as judge:
        out = judge.judge_turn(convo, items)
    # Step 0 is followed by an erroring tool response: its tool items fail without a request.
    assert out.verdicts == [[False, False, True], [False, False, False]]
    assert out.metrics["judge_short_circuit"] == 2
    assert out.metrics["judge_requests"] == 4
    assert not out.judge_failed


def test_bearer_key_and_non_retryable_client_errors():
    s = JudgeServer(api_key="s3cret")
    try:
        with LLMJudge(judge_config(s.base_url, api_key="s3cret")) as judge:
            assert judge.judge_turn(CONVERSATION, [item("KIWI")]).verdicts == [[False], [True]]
        with LLMJudge(judge_config(s.base_url, api_key="wrong")) as judge:
            out = judge.judge_turn(CONVERSATION, [item("KIWI")])
        assert out.verdicts == [[False], [False]] and out.judge_failed
        m = out.metrics
        assert (m["judge_requests"], m["judge_retries"], m["judge_http_errors"]) == (2, 0, 2)
        with LLMJudge(judge_config(s.base_url + "/nothing-here")) as judge:
            assert judge.judge_turn(CONVERSATION, [item("KIWI")]).metrics["judge_failures"] == 2
    finally:
        s.close()


def test_unreachable_server_fails_items_without_raising():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with LLMJudge(judge_config(f"http://127.0.0.1:{port}/v1", max_retries=1)) as judge:
        out = judge.judge_turn(CONVERSATION, [item("KIWI")])
    assert out.verdicts == [[False], [False]]
    assert out.metrics["judge_failures"] == 2 and out.metrics["judge_requests"] == 4


def test_concurrency_limit_holds_across_concurrent_turns(server):
    items = [item("KIWI", "[pace]") for _ in range(6)]

    async def many(judge):
        return await asyncio.gather(*(judge.ajudge_turn(CONVERSATION, items) for _ in range(3)))

    with LLMJudge(judge_config(server.base_url, concurrency=3)) as judge:
        outs = asyncio.run(many(judge))
    assert all(o.verdicts == [[False] * 6, [True] * 6] for o in outs)
    assert len(server.bodies) == 36
    assert server.max_in_flight <= 3


def test_parse_verdict():
    v = '{"answer": true, "analysis_of_pass_condition": "ok"}'
    assert parse_verdict(v) is True
    assert parse_verdict(f"```json\n{v}\n```") is True
    assert parse_verdict(f"Verdict follows. {v} Done.") is True
    assert parse_verdict("Reasoning...\nAnswer: FALSE") is False
    assert parse_verdict('<think>"answer": false</think>{"answer": true}') is True
    assert parse_verdict('{"answer": "false"}') is False
    assert parse_verdict('{"answer": 1}') is None
    assert parse_verdict("no verdict here") is None
    assert parse_verdict(None) is None


def test_render_messages_without_thinking_is_a_visible_reply():
    text = render_messages([{"role": "assistant", "content": "Plain reply."}])
    assert (
        "content.thinking: None\ncontent.user_visible_reply: Plain reply.\ntool_call: None" in text
    )


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="base_url"):
        JudgeConfig(base_url="localhost:8000", model="m")
    with pytest.raises(ValueError, match="concurrency"):
        JudgeConfig(base_url="http://x/v1", model="m", concurrency=0)
    with pytest.raises(ValueError, match="timeout_s"):
        JudgeConfig(base_url="http://x/v1", model="m", timeout_s=0)


def test_a_server_without_structured_output_is_judged_from_text(server):
    """With fallback_to_text, the first 400 refusing `response_format` switches the judge to
    plain requests, whose verdicts it parses; without it, the items fail, named."""
    items = [item("KIWI", "[no-schema]", weight=0.5), item("MANGO", "[no-schema]", weight=0.5)]
    with LLMJudge(judge_config(server.base_url, fallback_to_text=True, concurrency=1)) as judge:
        out = judge.judge_turn(CONVERSATION, items)
    assert out.verdicts == [[False, True], [True, False]] and not out.judge_failed
    assert out.metrics["judge_text_fallback"] == 1 and out.metrics["judge_failures"] == 0
    with_schema = [b for b in server.bodies if "response_format" in b]
    assert len(with_schema) == 1  # only the first request carried it
    with LLMJudge(judge_config(server.base_url)) as judge:
        out = judge.judge_turn(CONVERSATION, items)
        assert judge.first_error.startswith("HTTP 400: response_format")
    assert out.judge_failed and out.metrics["judge_failures"] == 4
