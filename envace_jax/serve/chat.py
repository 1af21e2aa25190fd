"""`POST /v1/chat/completions`: messages and tools in; content and parsed tool calls out.

A reply whose tool-call blocks parse is returned as `tool_calls` (finish reason `tool_calls`),
anything else as plain content. A call forced by `tool_choice` is decoded under its tool's
schema (`structured.compile_call`), so it is returned as a call; one that `max_tokens` cuts
before it can be read is returned as it stands, as content with finish reason `length` (what
the model wrote never makes a 500). Streaming sends content as it is generated, holding back
everything from the first tool-call block on, and the parsed calls in one delta at the end. A
`response_format` of type `json_schema` or `json_object` constrains the reply while it is
decoded (`structured`); it is then returned as content, unparsed for calls.
"""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import Request

from envace_jax.serve import forced
from envace_jax.serve import protocol as P
from envace_jax.serve.state import GONE, Choice, envelope, finish_reason, server
from envace_jax.serve.streaming import progress, sse, usage_chunk
from envace_jax.serve.text_stream import ChoiceText
from envace_jax.text.tool_calls import CALL_OPEN, parse_tool_calls

log = logging.getLogger("envace_jax.serve")


async def chat(req: P.ChatCompletionRequest, request: Request):
    state = server(request, req)
    state.check_rows(1, req.n, "n")
    grammar = await _grammar(state, req)
    built = await state.prompts.chat(req)
    prompt, prefix, parse_calls = built.ids, built.prefix, built.parse_calls
    tools = [t.model_dump() for t in req.tools or []]
    if grammar is not None:
        if prefix:
            raise P.APIError(
                400,
                "response_format: cannot be combined with a tool_choice that forces a tool call",
                param="response_format",
            )
        parse_calls = False  # the reply is the JSON content
    elif prefix and state.structured is not None:  # a forced call: its JSON under its schema
        named = (
            req.tool_choice.function.name
            if isinstance(req.tool_choice, P.NamedToolChoice)
            else None
        )
        grammar = await state.prompts.off_loop(state.structured.compile_call, tools, named, prefix)
    requested = req.max_completion_tokens or req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_new = state.prompts.budget(
        len(prompt), requested, state.config.default_max_tokens, param, "messages"
    )
    stops = req.stop_list()
    hold = (CALL_OPEN,) if parse_calls else ()

    def make_text():
        return ChoiceText(
            state.tokenizer,
            stops=stops,
            stop_ids=req.stop_token_ids or (),
            hold=hold,
            offsets=bool(req.logprobs),
            stop_at=(lambda text: _end_of_call(prefix, text)) if prefix else None,
        )

    rows = [(prompt, max_new)]
    sampling = req.sampling_params()
    choices = await state.start_choices(
        rows, sampling, req.n, make_text, prefix, req.seed, grammar=grammar
    )
    rid, model_name = P.new_id("chatcmpl"), req.model
    if req.stream:
        events = _stream(state, choices, rid, model_name, req, len(prompt), parse_calls, tools)
        return sse(events, choices, state.engine)
    if not await state.run_all(choices, request):
        return GONE
    out = []
    for i, c in enumerate(choices):
        message, reason = _message(c, parse_calls, req.parallel_tool_calls, tools)
        item = {"index": i, "message": message, "finish_reason": reason, "logprobs": None}
        if req.logprobs:
            item["logprobs"] = _logprobs(c, 0, len(c.text.ids))
        out.append(item)
    usage = P.usage(len(prompt), sum(c.done.num_generated for c in choices))
    return envelope("chat.completion", rid, model_name, out, usage=usage)


async def _grammar(state, req: P.ChatCompletionRequest):
    """The request's `response_format` grammar (`structured`), compiled on a worker thread;
    None for free text."""
    fmt = req.response_format
    if fmt is None or (fmt.type == "text" and fmt.json_schema is None):
        return None
    if state.structured is None:
        raise P.APIError(
            400, "response_format: this server has no structured output", param="response_format"
        )
    return await state.prompts.off_loop(state.structured.compile, fmt)


def _end_of_call(prefix: str, text: str) -> int | None:
    """Where a forced call's JSON object ends in the reply's `text` (after `prefix`)."""
    full = prefix + text
    start = full.find("{", full.find(CALL_OPEN))
    end = forced.json_end(full[start:])
    return None if end is None else max(0, start + end - len(prefix))


def _parsed_calls(c: Choice, parse_calls: bool, parallel: bool | None, tools):
    """(content, OpenAI tool calls or None) of a finished choice. A forced call that the reply
    does not give (cut by `max_tokens`, or decoded free) is the reply as content."""
    full = c.prefix + c.text.text
    if not parse_calls:
        return full, None
    if c.prefix:
        call, why = forced.read_call(full, tools)
        if call is None:  # the model's doing, not the server's: a 200 that shows it
            log.warning("tool_choice forces a tool call, but %s; answered as content", why)
            return full, None
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        function = {"name": call["name"], "arguments": arguments}
        call_id = "call_" + uuid.uuid4().hex[:24]
        return None, [{"id": call_id, "type": "function", "function": function}]
    action = parse_tool_calls(full)
    if action.error is not None or not action.calls:
        return full, None
    calls = list(action.calls)[: 1 if parallel is False else None]
    out = [{"id": "call_" + uuid.uuid4().hex[:24], **call.to_openai()} for call in calls]
    return action.content, out


def _message(c: Choice, parse_calls: bool, parallel, tools) -> tuple[dict, str]:
    content, calls = _parsed_calls(c, parse_calls, parallel, tools)
    reason = finish_reason(c)
    message = {"role": "assistant", "content": content}
    if calls:
        message["content"] = content or None
        message["tool_calls"] = calls
        if reason == "stop":
            reason = "tool_calls"
    return message, reason


def _logprobs(c: Choice, first: int, last: int) -> dict:
    """The logprobs of tokens [first, last) of a choice."""
    texts, logprobs = c.text.token_texts()[first:last], c.text.logprobs[first:last]
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(texts, logprobs, strict=True)
        ]
    }


def _visible(c: Choice, parse_calls: bool, finished: bool) -> str:
    """Content safe to stream: before any tool-call block, trailing newline held."""
    if parse_calls and c.prefix:
        return ""  # a forced call: the reply is a tool call from its first token
    text = c.text.streamable(finished)
    if parse_calls:
        cut = text.find(CALL_OPEN)
        if cut >= 0:
            text = text[:cut]
        if text.endswith("\n") and (cut >= 0 or not finished):
            text = text[:-1]
    return text


async def _stream(state, choices, rid, model_name, req, prompt_tokens, parse_calls, tools):
    def chunk(i, delta, reason=None, logprobs=None):
        choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        return envelope("chat.completion.chunk", rid, model_name, [choice])

    sent = [""] * len(choices)
    sent_tokens = [0] * len(choices)  # tokens whose logprobs were sent

    def logprobs(i: int, upto: int):
        """The logprobs of the tokens up to `upto` not sent yet (None without logprobs)."""
        if not req.logprobs or upto <= sent_tokens[i]:
            return None
        out, sent_tokens[i] = _logprobs(choices[i], sent_tokens[i], upto), upto
        return out

    def events(i: int, more: bool) -> list[dict]:
        c = choices[i]
        if more:
            text = _visible(c, parse_calls, False)
            if len(text) <= len(sent[i]):
                return []
            delta, sent[i] = text[len(sent[i]) :], text
            covered = c.text.sent_tokens(len(text)) if req.logprobs else 0
            return [chunk(i, {"content": delta}, logprobs=logprobs(i, covered))]
        message, reason = _message(c, parse_calls, req.parallel_tool_calls, tools)
        content = message.get("content") or ""
        if message.get("tool_calls") is None:
            content = c.prefix + c.text.text
        out = []
        if content.startswith(sent[i]) and len(content) > len(sent[i]):
            out.append(chunk(i, {"content": content[len(sent[i]) :]}))
        if message.get("tool_calls"):
            deltas = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            out.append(chunk(i, {"tool_calls": deltas}))
        rest = logprobs(i, len(c.text.ids))
        return [*out, chunk(i, {}, reason, rest)]

    for i in range(len(choices)):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for ev in progress(state, choices, events):
        yield ev
    if req.stream_options and req.stream_options.include_usage:
        yield usage_chunk("chat.completion.chunk", rid, model_name, prompt_tokens, choices)
