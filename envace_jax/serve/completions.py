"""`POST /v1/completions`: text in, text out (echo, logprobs, stop sequences, streaming)."""

from __future__ import annotations

from fastapi import Request

from envace_jax.serve import protocol as P
from envace_jax.serve.state import GONE, Choice, envelope, finish_reason, server
from envace_jax.serve.streaming import progress, sse, usage_chunk
from envace_jax.serve.text_stream import ChoiceText


async def completions(req: P.CompletionRequest, request: Request):
    state = server(request, req)
    prompts = state.prompts
    prompt_ids = await prompts.completion(req)
    budgets = [
        prompts.budget(len(p), req.max_tokens, None, "max_tokens", "prompt") for p in prompt_ids
    ]
    sampling = req.sampling_params()
    stops, stop_ids = req.stop_list(), req.stop_token_ids or ()

    def make_text():
        return ChoiceText(
            state.tokenizer,
            stops=stops,
            stop_ids=stop_ids,
            skip_special_tokens=req.skip_special_tokens,
        )

    choices = []
    for p, b in zip(prompt_ids, budgets, strict=True):
        choices += state.start_choices(p, b, sampling, req.n, make_text)
    rid, model_name = P.new_id("cmpl"), req.model
    prompt_tokens = sum(len(p) for p in prompt_ids)
    if req.stream:
        events = _stream(state, choices, rid, model_name, req, prompt_tokens)
        return sse(events, choices, state.engine)
    if not await state.run_all(choices, request):
        return GONE
    out = []
    for i, c in enumerate(choices):
        text = c.text.text
        if req.echo:
            ids = prompt_ids[i // req.n]
            text = state.tokenizer.decode(list(ids), skip_special_tokens=False) + text
        item = {"index": i, "text": text, "finish_reason": finish_reason(c), "logprobs": None}
        if req.logprobs is not None:
            item["logprobs"] = _logprobs(c)
        out.append(item)
    completion_tokens = sum(c.done.num_generated for c in choices)
    usage = P.usage(prompt_tokens, completion_tokens)
    return envelope("text_completion", rid, model_name, out, usage=usage)


def _logprobs(c: Choice) -> dict:
    tokens = c.text.token_texts()
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": c.text.logprobs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


async def _stream(state, choices, rid, model_name, req, prompt_tokens):
    sent = [""] * len(choices)

    def events(i: int, more: bool) -> list[dict]:
        c, out = choices[i], []
        text = c.text.streamable(finished=not more)
        if len(text) > len(sent[i]):
            delta, sent[i] = text[len(sent[i]) :], text
            out.append(_chunk(rid, model_name, i, delta, None))
        if not more:
            out.append(_chunk(rid, model_name, i, "", finish_reason(c)))
        return out

    async for ev in progress(state, choices, events):
        yield ev
    if req.stream_options and req.stream_options.include_usage:
        yield usage_chunk("text_completion", rid, model_name, prompt_tokens, choices)


def _chunk(rid, model_name, i, text, reason):
    choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
    return envelope("text_completion", rid, model_name, [choice])
