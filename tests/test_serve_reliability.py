"""The server as a hostile client and an unlucky operator would try it, over real HTTP on
127.0.0.1: text that is not valid Unicode, prompts too big to tokenize quickly, clients varying
sampling parameters, clients that hang up, bodies over the limit, faults inside the server, a
fuzz of malformed requests, and memory under a sustained load."""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from unittest import mock

import httpx
import pytest

from tests.serve_helpers import (
    MODEL,
    TOOL,
    chat,
    client,
    error_of,
    export_test_model,
    running_server,
)

KEY = "reliability-key-42"
MAX_LEN = 8192  # a long context: a hung-up request still has seconds of budget left


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reliability") / MODEL)
    export_test_model(path, max_position_embeddings=MAX_LEN)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    """The key comes from $ENVACE_API_KEY, as docs/operations.md advises."""
    with mock.patch.dict(os.environ, {"ENVACE_API_KEY": KEY}):
        with running_server(model_dir) as (url, proc):
            yield url, proc


@pytest.fixture(scope="module")
def http(server):
    with client(server[0], KEY) as c:
        yield c


def server_log(model_dir) -> str:
    return "".join(open(p).read() for p in glob.glob(os.path.join(model_dir, "port-*.log")))


def engine_stats(http) -> dict:
    return http.get("/health").json()["engine"]


# ---------------------------------------------------------------------------------------------
# Text that is not valid Unicode

SURROGATE_CASES = [  # (path, body as JSON text with a raw \ud800 escape, param named)
    ("/v1/chat/completions", chat("a\\ud800b"), "messages[0].content"),
    (
        "/v1/chat/completions",
        chat([{"type": "text", "text": "ok"}, {"type": "text", "text": "\\udfff"}]),
        "messages[0].content[1].text",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x\\udc00"}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", "\\ud83d"]}, "prompt[1]"),
    (
        "/v1/chat/completions",
        chat("hi", tools=[{**TOOL, "function": {**TOOL["function"], "description": "\\ud800"}}]),
        "tools[0].function.description",
    ),
    ("/v1/chat/completions", chat("hi", stop=["\\udbff"]), "stop[0]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "user": "\\ud800"}, "user"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_CASES)
def test_lone_surrogate_is_a_400_naming_the_field(http, model_dir, path, body, param):
    raw = json.dumps(body).replace("\\\\u", "\\u")  # the JSON escape itself, unpaired
    err = error_of(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and "surrogate" in err["message"], err
    assert "Traceback" not in server_log(model_dir)


# ---------------------------------------------------------------------------------------------
# One large prompt does not freeze the server


def test_a_huge_prompt_is_refused_before_tokenizing_and_health_stays_live(server, http):
    """~3.9 MB of text, under the 4 MiB body limit: tokenized on the event loop it froze every
    client for tens of seconds; now it is refused by its length, off the event loop."""
    text = "".join(f"{i} apples, " for i in range(400_000))[:3_900_000]
    many = [{"role": "user", "content": text[i : i + 3900]} for i in range(0, len(text), 3900)]
    bodies = [
        ("/v1/chat/completions", chat(text, max_tokens=1)),
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": many, "max_tokens": 1}),
    ]
    answers, latencies, done = {}, [], threading.Event()

    def big(i, path, body):
        answers[i] = http.post(path, json=body)

    def poll():
        with httpx.Client(base_url=server[0], timeout=60) as c:
            while not done.is_set():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.05)

    threads = [threading.Thread(target=big, args=(i, *b)) for i, b in enumerate(bodies)]
    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    done.set()
    poller.join(60)
    assert len(answers) == len(bodies) and latencies
    assert max(latencies) < 3.0, f"/health stalled for {max(latencies):.1f}s"
    for resp in answers.values():
        err = error_of(resp, 400)
        assert err["code"] == "context_length_exceeded" and "characters" in err["message"]


# ---------------------------------------------------------------------------------------------
# Sampling parameters, disconnects, limits, the key


def test_requests_with_different_sampling_share_one_compiled_program(http):
    """Each temperature / top_p / top_k used to compile a program of its own (seconds each,
    memory kept forever): a client could take the server down by varying them."""
    body = {"model": MODEL, "prompt": "Order 17 for Ada", "max_tokens": 8}
    assert http.post("/v1/completions", json={**body, "temperature": 0}).status_code == 200
    before = engine_stats(http)
    assert before["compiled_programs"] > 0  # jax.monitoring still reports XLA's compiles
    settings = [
        {"temperature": 0.31},
        {"temperature": 1.7, "top_p": 0.42},
        {"temperature": 0.9, "top_k": 3},
        {"temperature": 1.1, "top_k": 50, "top_p": 0.9},
        {"temperature": 0.05, "top_p": 0.999},
        {"temperature": 2.0, "top_k": 1},
    ]
    for s in settings:
        resp = http.post("/v1/completions", json={**body, **s})
        assert resp.status_code == 200, resp.text
    after = engine_stats(http)
    assert after["decode_programs"] == before["decode_programs"]
    assert after["compiled_programs"] == before["compiled_programs"], "no program at all"


def test_non_streaming_request_is_cancelled_when_its_client_leaves(server, http):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4000, "temperature": 0.0}
    before = {k: n for k, n in engine_stats(http).items() if k.startswith("finished_")}
    with httpx.Client(timeout=1.0, headers={"Authorization": f"Bearer {KEY}"}) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(server[0] + "/v1/completions", json=body)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stats = engine_stats(http)
        after = {k: n for k, n in stats.items() if k.startswith("finished_")}
        if after != before:
            break
        time.sleep(0.05)
    ended = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert ended == {"finished_cancelled": 1}, (before, after)


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():
        yield b'{"model": "tiny-qwen3", "prompt": "'
        for _ in range(80):
            yield b"x" * 65536  # 5 MiB in all, over the default 4 MiB, no Content-Length
        yield b'"}'

    resp = http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    err = error_of(resp, 413)
    assert err["code"] == "request_too_large"


def test_the_key_comes_from_the_environment_and_not_the_command_line(server, http):
    url, proc = server
    with httpx.Client(base_url=url, timeout=60) as anonymous:
        assert anonymous.post("/v1/completions", json={"model": MODEL}).status_code == 401
    assert http.get("/v1/models").status_code == 200
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()


# ---------------------------------------------------------------------------------------------
# Faults inside the server: a 500 with a request id, never the exception


class _FaultyEngine:
    """Engine stand-in: `submit` either raises or fails the row as the real engine does when a
    batch fails."""

    running, stats = True, {}

    def __init__(self, raise_on_submit: bool):
        self.raise_on_submit = raise_on_submit

    def start(self):
        return self

    def stop(self):
        pass

    def cancel(self, seq):
        pass

    def submit(self, seq):
        from envace_jax.serve.sequences import Done

        if self.raise_on_submit:
            raise ZeroDivisionError("secret detail of a bug")
        seq.on_event(Done("error", 0, error="XlaRuntimeError: secret device detail"))
        return seq


@pytest.mark.parametrize("raise_on_submit", [True, False])
def test_a_server_fault_is_a_500_with_a_request_id_and_no_internals(raise_on_submit, caplog):
    import uvicorn

    from envace_jax.serve.app import ServerConfig, create_app
    from envace_jax.text.tokenizer import load_tokenizer

    app = create_app(
        _FaultyEngine(raise_on_submit), load_tokenizer("demo"), ServerConfig(MODEL, 256)
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream}
            resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            text = resp.text
            assert "secret" not in text and "Error" not in text.replace("server_error", "")
            if stream and not raise_on_submit:  # the stream had started: an error event
                assert resp.status_code == 200
                err = json.loads(text.split("data: ")[1])["error"]
            else:
                err = error_of(resp, 500)
            rid = err["message"].split("request id ")[1].split(";")[0]
            logged = [r for r in caplog.records if rid in r.getMessage()]
            assert len(logged) == 1 and "secret" in (
                logged[0].getMessage() + str(logged[0].exc_info)
            )
    finally:
        server.should_exit = True
        thread.join(30)


# ---------------------------------------------------------------------------------------------
# Fuzz: malformed and hostile requests are all 4xx, and the server lives on

C, P = "/v1/chat/completions", "/v1/completions"
_FN = TOOL["function"]


def _tool(**function):
    return {"type": "function", "function": {**_FN, **function}}


def _deep_parameters(depth: int) -> bytes:
    """A chat request whose tool parameters nest `depth` objects deep, as raw JSON."""
    body = json.dumps(chat("hi", tools=[_tool(parameters="DEEP")]))
    return body.replace('"DEEP"', '{"a": ' * depth + "1" + "}" * depth).encode()


def _cases() -> list[tuple[str, str, object]]:
    """(method, path, body): a dict or list is sent as JSON, bytes as they are."""
    ok_chat = chat("hi", max_tokens=2)
    ok_cmpl = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    cases: list[tuple[str, str, object]] = []
    # Bad JSON and bad bytes.
    for raw in [
        b"",
        b"{",
        b"null",
        b"[]",
        b'"text"',
        b'{"model": "tiny-qwen3",}',
        b'{"a": 1}{"b": 2}',
        b"\xff\xfe\x00garbage",
        b'{"model": "tiny-qwen3", "prompt": "\xc0\xaf"}',  # an overlong UTF-8 encoding
        b"[" * 200_000 + b"]" * 200_000,  # nesting deeper than any parser's stack
        b'{"model": "tiny-qwen3", "prompt": "hi", "temperature": NaN}',
        b'{"model": "tiny-qwen3", "prompt": "hi", "max_tokens": Infinity}',
    ]:
        cases += [("POST", C, raw), ("POST", P, raw)]
    # Wrong types and out-of-range values, field by field.
    for field, values in {
        "model": [1, None, ["tiny-qwen3"]],
        "messages": ["hi", [], [1], [{"role": "wizard", "content": "x"}], [{"content": "x"}]],
        "temperature": ["hot", -0.1, 2.5, 1e308],
        "top_p": [0, 1.5, "x"],
        "top_k": [-2, 1.5],
        "n": [0, 17, "2"],
        "stream": ["yes", 2],
        "stream_options": [{"include_usage": "x"}, {"other": True}, 5],
        "stop": [5, ["a", "b", "c", "d", "e"], [""], [1]],
        "stop_token_ids": ["x", [1.5]],
        "seed": ["x"],
        "user": [5],
        "presence_penalty": [1.0, "x"],
        "frequency_penalty": [-1.0],
        "logit_bias": [{"1": 5.0}, "x"],
        "max_tokens": [0, -5, 10**12, "x", 1.5, MAX_LEN],
        "max_completion_tokens": [0],
        "logprobs": ["x"],
        "top_logprobs": [21, 3],
        "response_format": [{"type": "xml"}, "x"],
        "metadata": [5],
        "store": [True],
        "parallel_tool_calls": ["yes"],
        "tool_choice": [5, "sometimes", {"type": "function"}],
        "tools": ["x", [{}], [{"type": "code_interpreter"}]],
        "temprature": [0.5],  # an unknown field
    }.items():
        cases += [("POST", C, {**ok_chat, field: v}) for v in values]
    for field, values in {
        "prompt": [5, [], [[]], [-1], [10**9], [1.5], [[1, "a"]], {"a": 1}, [5] * MAX_LEN],
        "echo": ["x"],
        "suffix": ["tail"],
        "best_of": [2],
        "logprobs": [5, -1],
    }.items():
        cases += [("POST", P, {**ok_cmpl, field: v}) for v in values]
    cases.append(("POST", P, {**ok_cmpl, "echo": True, "stream": True}))
    cases += [
        ("POST", C, {k: v for k, v in ok_chat.items() if k != f}) for f in ("model", "messages")
    ]
    # Messages and tools that cannot be rendered as asked.
    cases += [
        ("POST", C, chat([{"type": "image_url", "image_url": {"url": "x"}}])),
        ("POST", C, chat([{"type": "text"}])),
        ("POST", C, chat(5)),
        (
            "POST",
            C,
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}
                ],
            },
        ),
        ("POST", C, {**ok_chat, "messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]}),
        ("POST", C, chat("hi", tools=[{"type": "function"}])),
        ("POST", C, chat("hi", tools=[{"type": "function", "function": {"description": "x"}}])),
        ("POST", C, chat("hi", tools=[_tool(name="")])),
        ("POST", C, chat("hi", tools=[_tool(name="f" * 300)])),
        ("POST", C, chat("hi", tools=[_tool(parameters="a string")])),
        ("POST", C, chat("hi", tools=[_tool(parameters=[1, 2])])),
        ("POST", C, chat("hi", tools=[_tool(strict="x")])),
        ("POST", C, chat("hi", tools=[_tool(extra=1)])),
        ("POST", C, _deep_parameters(900)),
        ("POST", C, _deep_parameters(5000)),
        (
            "POST",
            C,
            chat("hi", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "no"}}),
        ),
        ("POST", C, chat("hi", tool_choice={"type": "function", "function": {"name": "f"}})),
        ("POST", C, chat("hi", tool_choice="required")),
    ]
    # Unknown models, huge bodies, methods and routes.
    for name in ["gpt-4o", "", " tiny-qwen3", "TINY-QWEN3", "../tiny-qwen3", "tiny\u2010qwen3"]:
        cases += [("POST", C, {**ok_chat, "model": name}), ("POST", P, {**ok_cmpl, "model": name})]
    cases += [
        ("POST", P, {**ok_cmpl, "prompt": "x" * (5 * 2**20)}),
        ("POST", C, {**ok_chat, "n": 16, "max_tokens": MAX_LEN}),
        ("POST", C, {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 60_000}),
        ("GET", C, None),
        ("POST", "/v1/models", {}),
        ("DELETE", "/v1/models/tiny-qwen3", None),
        ("POST", "/v1/embeddings", {"model": MODEL, "input": "x"}),
        ("GET", "/v1/models/gpt-4o", None),
    ]
    # Lone surrogates in raw JSON (json.dumps would escape the backslash), in each kind of place.
    assistant = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "PLACE"}}}],
    }
    for path, body in [
        (C, chat("PLACE")),
        (C, chat("hi", tools=[_tool(name="PLACE")])),
        (C, chat("hi", tools=[_tool(parameters={"type": "object", "PLACE": {}})])),
        (C, {"model": MODEL, "messages": [{"role": "user", "content": "x"}, assistant]}),
        (P, {"model": "PLACE", "prompt": "hi"}),
        (P, {"model": MODEL, "prompt": "hi", "PLACE": 1}),
        (P, {"model": MODEL, "prompt": ["a", "PLACE"]}),
    ]:
        cases.append(("POST", path, json.dumps(body).replace("PLACE", "\\ud800").encode()))
    return cases


def test_fuzz_every_answer_is_a_4xx_with_a_message_and_health_answers(server, http):
    cases = _cases()
    assert len(cases) >= 70
    failures = []
    with httpx.Client(base_url=server[0], timeout=60) as plain:
        for i, (method, path, body) in enumerate(cases):
            kw = {"headers": {"content-type": "application/json"}}
            if isinstance(body, bytes | str):
                kw["content"] = body
            elif body is not None:
                kw["content"] = json.dumps(body)
            resp = http.request(method, path, **kw)
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = None
            if not (400 <= resp.status_code < 500 and message):
                failures.append(
                    (i, method, path, str(body)[:120], resp.status_code, resp.text[:200])
                )
            assert plain.get("/health").status_code == 200, f"case {i} took the server down"
    assert not failures, "\n".join(map(str, failures))


# ---------------------------------------------------------------------------------------------
# Memory under a sustained load


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.slow
def test_soak_memory_levels_off(server, http):
    """32 clients x rounds of mixed requests (chat with tools, streamed completions, each with
    sampling parameters never used before): the server's resident memory grows only in rounds
    that compile a program. Each program's code and buffers stay, and which shapes a round meets
    depends on how the clients' requests interleave: on a loaded machine a new prefill or batch
    move still compiled in round 16 (65 programs in all), its memory flat in between. Requests
    themselves must leave nothing: over the rounds that compile nothing (at least five), the
    memory grows by at most 5% of its first round's (measured: 2 and 6 MiB of ~600)."""
    import random

    url, proc = server
    max_rounds, quiet_needed, clients, rss, compiled = 20, 5, 32, [], []
    rng = random.Random(0)

    def client(i, r, settings, errors):
        s = settings[i]
        try:
            with httpx.Client(base_url=url, timeout=300, headers=http.headers) as c:
                resp = c.post(C, json=chat(f"Order {i} please", tools=[TOOL], max_tokens=12, **s))
                assert resp.status_code == 200, resp.text
                body = {"model": MODEL, "prompt": f"Refund {i}", "max_tokens": 16, "stream": True}
                with c.stream("POST", P, json={**body, **s}) as stream:
                    lines = [line for line in stream.iter_lines() if line]
                assert lines[-1] == "data: [DONE]", lines[-3:]
        except Exception as e:  # reported below
            errors.append(f"round {r} client {i}: {e!r}")

    def quiet() -> list[int]:  # the rounds after the first that compiled nothing
        return [r for r in range(1, len(compiled)) if compiled[r] == compiled[r - 1]]

    for r in range(max_rounds):
        settings = [
            {"temperature": rng.uniform(0.1, 1.9), "top_p": rng.uniform(0.5, 1.0)}
            for _ in range(clients)
        ]
        errors: list[str] = []
        threads = [
            threading.Thread(target=client, args=(i, r, settings, errors)) for i in range(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors[:5]
        rss.append(_rss_mib(proc.pid))
        compiled.append(engine_stats(http)["compiled_programs"])
        if len(quiet()) >= quiet_needed:
            break
    print("server RSS per round (MiB):", [round(m, 1) for m in rss])
    print("programs compiled by each round's end:", compiled)
    print("engine:", engine_stats(http))
    assert len(quiet()) >= quiet_needed, f"a new program in almost every round: {compiled}"
    growth = sum(max(rss[r] - rss[r - 1], 0.0) for r in quiet())
    assert growth <= 0.05 * rss[0], f"+{growth:.1f} MiB in rounds that compiled nothing: {rss}"
