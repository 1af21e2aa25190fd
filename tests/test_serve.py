"""The OpenAI-compatible server, through real HTTP clients (openai, litellm, httpx) against a
server process on localhost. References: the transformers PyTorch model's greedy decoding of
the same checkpoint, and transformers' own chat-template rendering."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.serve_helpers import (
    EXPECTED_ARGUMENTS,
    TOOL,
    TorchReference,
    export_test_model,
    running_server,
)

API_KEY = "test-key-123"
MAX_LEN = 1024
BODY_LIMIT = 64 * 1024
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("served") / "tiny-qwen3")
    export_test_model(path, max_position_embeddings=MAX_LEN)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from envace_jax.text.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    return TorchReference(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    extra = ["--api-key", API_KEY, "--max-request-bytes", str(BODY_LIMIT), "--max-batch", "16"]
    with running_server(model_dir, *extra) as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _raw_prompt(tokenizer, text):
    from envace_jax.text.chat import render_text

    return render_text(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def _im_end(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def _post(server, path, body=None, *, key=API_KEY, content=None, headers=None):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    with httpx.Client(timeout=300) as c:
        if content is not None:
            h.setdefault("content-type", "application/json")
            return c.post(server[0] + path, content=content, headers=h)
        return c.post(server[0] + path, json=body, headers=h)


# ---------------------------------------------------------------------------------------------
# Happy paths


def test_models_lists_the_served_model(client, model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-qwen3"]
    assert client.models.retrieve("tiny-qwen3").id == "tiny-qwen3"


def test_completion_is_the_torch_greedy_continuation(client, tokenizer, reference):
    prompt = _raw_prompt(tokenizer, "Book a table for two tonight")
    ids = _ids(tokenizer, prompt)
    want = reference.greedy(ids, 12, stop_ids={_im_end(tokenizer)})
    got = client.completions.create(model="tiny-qwen3", prompt=prompt, max_tokens=12, temperature=0)
    stopped = want[-1] == _im_end(tokenizer)
    assert got.choices[0].text == _decode(tokenizer, want[:-1] if stopped else want)
    assert got.choices[0].finish_reason == ("stop" if stopped else "length")
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == len(want)
    # The same prompt given as token ids.
    again = client.completions.create(model="tiny-qwen3", prompt=ids, max_tokens=12, temperature=0)
    assert again.choices[0].text == got.choices[0].text


def test_completion_stop_sequence_cuts_the_text(client, tokenizer, reference):
    prompt = _raw_prompt(tokenizer, "Cancel my order please")
    full = _decode(tokenizer, reference.greedy(_ids(tokenizer, prompt), 16))
    stop = full[5:8]
    assert stop and full.find(stop) >= 0
    got = client.completions.create(
        model="tiny-qwen3", prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
    )
    assert got.choices[0].text == full[: full.find(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_streamed_completion_concatenates_to_the_full_text(client, tokenizer, reference):
    prompt = _raw_prompt(tokenizer, "Transfer 20 euros to Alice")
    want = reference.greedy(_ids(tokenizer, prompt), 40, stop_ids={_im_end(tokenizer)})
    want = want[:-1] if want[-1] == _im_end(tokenizer) else want
    stream = client.completions.create(
        model="tiny-qwen3",
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        for ch in chunk.choices:
            pieces.append(ch.text)
            reasons.append(ch.finish_reason)
        usage = chunk.usage or usage
    assert "".join(pieces) == _decode(tokenizer, want)
    assert len([p for p in pieces if p]) > 1, "text came in one piece: not streamed"
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.prompt_tokens == len(_ids(tokenizer, prompt))


def test_chat_returns_parsed_tool_calls(client):
    out = client.chat.completions.create(
        model="tiny-qwen3",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[TOOL],
        tool_choice=NAMED,
        temperature=0,
        max_tokens=30,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == EXPECTED_ARGUMENTS
    assert call.id.startswith("call_") and not choice.message.content


def test_streamed_tool_calls_match_the_unstreamed_ones(client):
    kw = dict(
        model="tiny-qwen3",
        messages=[{"role": "user", "content": "Weather in Paris, please"}],
        tools=[TOOL],
        tool_choice=NAMED,
        temperature=0,
        max_tokens=30,
    )
    plain = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            reason = ch.finish_reason or reason
    assert reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (p.function.name, json.loads(p.function.arguments)) for p in plain
    ]


def test_chat_without_tool_call_is_the_torch_greedy_reply(client, tokenizer, reference):
    messages = [{"role": "system", "content": "You are a shop assistant."}]
    messages += [{"role": "user", "content": "Do you sell umbrellas?"}]
    ids = _ids(tokenizer, _render_with_tools(tokenizer, messages))
    want = reference.greedy(ids, 20, stop_ids={_im_end(tokenizer)})
    out = client.chat.completions.create(
        model="tiny-qwen3", messages=messages, tools=[TOOL], temperature=0, max_tokens=20
    )
    text = _decode(tokenizer, want[:-1] if want[-1] == _im_end(tokenizer) else want)
    # Random text: if it happens to hold a well-formed call it is parsed, otherwise it is content.
    if "<tool_call>" not in text:
        assert out.choices[0].message.content == text
        assert out.choices[0].message.tool_calls is None
    assert out.usage.prompt_tokens == len(ids)


def _render_with_tools(tokenizer, messages):
    return tokenizer.apply_chat_template(
        messages, tools=[TOOL], add_generation_prompt=True, tokenize=False
    )


def test_litellm_multi_turn_tool_exchange(server, tokenizer, reference):
    """litellm's OpenAI-compatible client: a call, its result, and the reply that follows are
    rendered by the server exactly as transformers renders the conversation."""
    import litellm

    kw = dict(
        model="openai/tiny-qwen3",
        api_base=server[0] + "/v1",
        api_key=API_KEY,
        tools=[TOOL],
        temperature=0,
        max_tokens=30,
    )
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = litellm.completion(messages=messages, tool_choice=NAMED, **kw)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == EXPECTED_ARGUMENTS

    messages.append(msg.model_dump())
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'})
    second = litellm.completion(messages=messages, **kw)

    reference_conv = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "content": '{"temp_c": 18}'},
    ]
    ids = _ids(tokenizer, _render_with_tools(tokenizer, reference_conv))
    assert second.usage.prompt_tokens == len(ids)
    want = reference.greedy(ids, 30, stop_ids={_im_end(tokenizer)})
    text = _decode(tokenizer, want[:-1] if want[-1] == _im_end(tokenizer) else want)
    if "<tool_call>" not in text:
        assert second.choices[0].message.content == text


def test_sixteen_concurrent_clients_each_get_their_own_greedy_text(client, tokenizer, reference):
    prompts = [_raw_prompt(tokenizer, f"Order number {i} for customer {i * 7}") for i in range(16)]
    lengths = [6 + (i % 5) * 3 for i in range(16)]  # rows finish at different steps
    results: dict[int, str] = {}
    errors = []

    def worker(i):
        try:
            out = client.completions.create(
                model="tiny-qwen3", prompt=prompts[i], max_tokens=lengths[i], temperature=0
            )
            results[i] = out.choices[0].text
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(results) == 16
    # A row ends at the end of its turn or at the end of text (the server's stop ids).
    stops = {_im_end(tokenizer), tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    for i in range(16):
        want = reference.greedy(_ids(tokenizer, prompts[i]), lengths[i], stop_ids=stops)
        want = want[:-1] if want[-1] in stops else want
        assert results[i] == _decode(tokenizer, want), f"client {i}"


def test_slow_streaming_reader_does_not_stall_other_clients(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny-qwen3", "prompt": "hello", "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=300) as slow:
        with slow.stream("POST", server[0] + "/v1/completions", json=body, headers=headers) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: ")
            # The slow client stops reading; another client is served meanwhile.
            other = client.completions.create(model="tiny-qwen3", prompt="hi", max_tokens=5)
            assert other.choices[0].finish_reason in ("stop", "length")
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_n_choices_and_logprobs(client, tokenizer, reference):
    prompt = _raw_prompt(tokenizer, "Reschedule my meeting")
    ids = _ids(tokenizer, prompt)
    out = client.chat.completions.create(
        model="tiny-qwen3",
        messages=[{"role": "user", "content": "Reschedule my meeting"}],
        n=3,
        temperature=0,
        max_tokens=8,
        logprobs=True,
    )
    assert len(out.choices) == 3 and [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1  # greedy: identical
    want = reference.greedy(ids, 8)
    import torch

    with torch.no_grad():
        logits = reference.model(torch.tensor([ids + want])).logits[0]
    ref_lp = torch.log_softmax(logits, -1)
    n = len(out.choices[0].logprobs.content)
    for k in range(n):
        expected = float(ref_lp[len(ids) - 1 + k, want[k]])
        assert abs(out.choices[0].logprobs.content[k].logprob - expected) < 1e-3


# ---------------------------------------------------------------------------------------------
# Bad requests: OpenAI's error format, a 4xx that names the problem, and the server lives on


def _err(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_bad_json(server):
    err = _err(_post(server, "/v1/chat/completions", content=b'{"model": "tiny-qwen3",'), 400)
    assert "JSON" in err["message"]


def test_unknown_field(server):
    body = {"model": "tiny-qwen3", "prompt": "hi", "max_tokens": 2, "temprature": 0.5}
    err = _err(_post(server, "/v1/completions", body), 400)
    assert "temprature" in err["message"] and "unknown field" in err["message"]


def test_wrong_type_and_missing_field(server):
    err = _err(
        _post(
            server, "/v1/completions", {"model": "tiny-qwen3", "prompt": "hi", "max_tokens": "x"}
        ),
        400,
    )
    assert "max_tokens" in err["message"]
    err = _err(_post(server, "/v1/chat/completions", {"model": "tiny-qwen3"}), 400)
    assert "messages" in err["message"] and "required" in err["message"]


def test_unknown_model(client):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert "gpt-9" in str(e.value)


def test_over_long_prompt_and_max_tokens_beyond_context(client, tokenizer):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-qwen3", prompt=[5] * MAX_LEN, max_tokens=1)
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_LEN
        )
    assert "max_tokens" in str(e.value) and "maximum context length" in str(e.value)


def test_unsupported_parameters(client):
    import openai

    msgs = [{"role": "user", "content": "hi"}]
    for kw, name in [
        (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logprobs=True, top_logprobs=3), "top_logprobs"),
        (dict(response_format={"type": "xml"}), "response_format"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-qwen3", messages=msgs, max_tokens=2, **kw)
        assert name in str(e.value)
    bad_part = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-qwen3", messages=bad_part, max_tokens=2)
    assert "messages[0].content[0]" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny-qwen3", messages=msgs, max_tokens=2, tool_choice=NAMED
        )
    assert "tool_choice" in str(e.value)


def test_api_key_is_required(server):
    body = {"model": "tiny-qwen3", "prompt": "hi", "max_tokens": 2}
    assert _err(_post(server, "/v1/completions", body, key=None), 401)["type"] == (
        "authentication_error"
    )
    _err(_post(server, "/v1/completions", body, key="wrong"), 401)
    with httpx.Client() as c:
        assert c.get(server[0] + "/health").status_code == 200  # health needs no key


def test_request_size_limit(server):
    body = {"model": "tiny-qwen3", "prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 2}
    err = _err(_post(server, "/v1/completions", body), 413)
    assert str(BODY_LIMIT) in err["message"]


def test_unknown_route(server):
    _err(_post(server, "/v1/embeddings", {"model": "tiny-qwen3", "input": "x"}), 404)


@pytest.mark.slow  # starts a second server
def test_hung_up_stream_is_cancelled_and_the_server_goes_on(tmp_path):
    """A client that hangs up mid-stream: its row is stopped early, not decoded to the end of
    its budget, and the server answers the next request.

    The server notices a hang-up one to a few decode chunks later; the row must still be
    running then, on a loaded machine too, so a long context gives the stream a budget of
    seconds. The row must end as 'cancelled' and as nothing else: a race in the engine once
    ended such rows as 'stop' (`test_serve_batcher` pins it down).
    """
    model_dir = str(tmp_path / "tiny-qwen3")
    export_test_model(model_dir, max_position_embeddings=8192)
    body = {"model": "tiny-qwen3", "prompt": "hello", "max_tokens": 4096, "temperature": 0.0}
    body["stop"] = None
    with running_server(model_dir) as (url, proc), httpx.Client(timeout=300) as c:

        def finished() -> dict[str, int]:
            stats = c.get(url + "/health").json()["engine"]
            return {k: n for k, n in stats.items() if k.startswith("finished_")}

        # Greedy, so the same request is known to run its whole budget when nobody hangs up.
        full = c.post(url + "/v1/completions", json=body).json()
        assert full["choices"][0]["finish_reason"] == "length", full["choices"][0]
        before = finished()
        with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            next(line for line in r.iter_lines() if line)  # then hang up mid-stream
        deadline = time.monotonic() + 120
        while (after := finished()) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        assert ended == {"finished_cancelled": 1}, (before, after)
        out = c.post(url + "/v1/completions", json={**body, "max_tokens": 3}).json()
        assert out["choices"][0]["finish_reason"] == "length"
        assert proc.poll() is None


@pytest.mark.slow  # starts a second server
def test_graceful_shutdown_finishes_running_streams(model_dir):
    """SIGTERM while a stream is running: the stream completes, then the process exits 0."""
    with running_server(model_dir) as (url, proc):
        body = {"model": "tiny-qwen3", "prompt": "hi", "max_tokens": 300, "stream": True}
        body["temperature"], body["stop"] = 1.0, None
        chunks = []
        with httpx.Client(timeout=300) as c:
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                chunks.append(next(line for line in lines if line))
                proc.send_signal(signal.SIGTERM)
                chunks += [line for line in lines if line]
        assert chunks[-1] == "data: [DONE]"
        last = json.loads(chunks[-2][6:])["choices"][0]
        assert last["finish_reason"] in ("stop", "length")
        assert proc.wait(60) == 0
