"""`POST /v1/completions`: text in, text out (echo, logprobs, stop sequences, streaming).

`logprobs` cover the completion's tokens: `text_offset` counts from the start of the returned
text (the prompt included with `echo`), and a stream carries each token's entry in the event
that completes its text.
"""

from __future__ import annotations

from fastapi import Request

from envace_jax.serve import protocol as P
from envace_jax.serve.state import GONE, Choice, envelope, finish_reason, server
from envace_jax.serve.streaming import progress, sse, usage_chunk
from envace_jax.serve.text_stream import ChoiceText


async def completions(req: P.CompletionRequest, request: Request):
    state = server(request, req)
    state.check_rows(len(req.prompt_items()), req.n, "prompt")
    rows = await state.prompts.completion(req)
    stops, stop_ids = req.stop_list(), req.stop_token_ids or ()
    want_logprobs = req.logprobs is not None

    def make_text():
        return ChoiceText(
            state.tokenizer,
            stops=stops,
            stop_ids=stop_ids,
            skip_special_tokens=req.skip_special_tokens,
            offsets=want_logprobs,
        )

    choices = await state.start_choices(
        rows, req.sampling_params(), req.n, make_text, seed=req.seed
    )
    rid, model_name = P.new_id("cmpl"), req.model
    prompt_tokens = sum(len(ids) for ids, _ in rows)
    if req.stream:
        events = _stream(state, choices, rid, model_name, req, prompt_tokens)
        return sse(events, choices, state.engine)
    if not await state.run_all(choices, request):
        return GONE
    out = []
    for i, c in enumerate(choices):
        text, base = c.text.text, ""
        if req.echo:
            ids = rows[i // req.n][0]
            base = state.tokenizer.decode(list(ids), skip_special_tokens=False)
        item = {"index": i, "text": base + text, "finish_reason": finish_reason(c)}
        item["logprobs"] = _logprobs(c, 0, len(c.text.ids), len(base)) if want_logprobs else None
        out.append(item)
    completion_tokens = sum(c.done.num_generated for c in choices)
    usage = P.usage(prompt_tokens, completion_tokens)
    return envelope("text_completion", rid, model_name, out, usage=usage)


def _logprobs(c: Choice, first: int, last: int, base: int) -> dict:
    """The logprobs of tokens [first, last) of a choice; offsets shifted by `base` (echo)."""
    tokens = c.text.token_texts()[first:last]
    return {
        "tokens": tokens,
        "token_logprobs": c.text.logprobs[first:last],
        "top_logprobs": None,
        "text_offset": [base + o for o in c.text.offsets[first:last]],
    }


async def _stream(state, choices, rid, model_name, req, prompt_tokens):
    sent = [""] * len(choices)
    sent_tokens = [0] * len(choices)  # tokens whose logprobs were sent

    def events(i: int, more: bool) -> list[dict]:
        c, out = choices[i], []
        text = c.text.streamable(finished=not more)
        delta = text[len(sent[i]) :] if len(text) > len(sent[i]) else ""
        sent[i] = sent[i] + delta
        logprobs = None
        if req.logprobs is not None:
            upto = c.text.sent_tokens(len(sent[i])) if more else len(c.text.ids)
            if upto > sent_tokens[i]:
                logprobs = _logprobs(c, sent_tokens[i], upto, 0)
                sent_tokens[i] = upto
        if delta or logprobs:
            out.append(_chunk(rid, model_name, i, delta, None, logprobs))
        if not more:
            out.append(_chunk(rid, model_name, i, "", finish_reason(c), None))
        return out

    async for ev in progress(state, choices, events):
        yield ev
    if req.stream_options and req.stream_options.include_usage:
        yield usage_chunk("text_completion", rid, model_name, prompt_tokens, choices)


def _chunk(rid, model_name, i, text, reason, logprobs):
    choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": logprobs}
    return envelope("text_completion", rid, model_name, [choice])
