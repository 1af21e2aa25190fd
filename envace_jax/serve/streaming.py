"""Server-sent events: the choices' progress as it happens, written in one piece per wait.

A streaming handler turns `progress` (which choice the engine advanced, and whether it has
more) into event dicts, and `sse` writes them; `FLUSH` marks where the stream is about to wait.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi.responses import StreamingResponse

from envace_jax.serve import errors
from envace_jax.serve import protocol as P
from envace_jax.serve.batcher import Engine
from envace_jax.serve.state import Choice, ServerState, envelope

# Yielded by the event streams before they wait: what they yielded since is written at once.
FLUSH = None


async def progress(
    state: ServerState, choices: Sequence[Choice], events: Callable[[int, bool], list[dict]]
):
    """Runs the choices to their end, yielding FLUSH before each wait for the engine and then
    `events(i, more)` for every choice i that advanced; `more` is False once the choice is done
    (its last text is in by then)."""
    pending = {asyncio.ensure_future(state.pump(c)): i for i, c in enumerate(choices)}
    try:
        while pending:
            yield FLUSH
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                more = fut.result()
                for ev in events(i, more):
                    yield ev
                if more:
                    pending[asyncio.ensure_future(state.pump(choices[i]))] = i
    finally:  # a hang-up or an error: the other choices' waits end quietly, not left pending
        for fut in pending:
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: asyncio would log it with a traceback
            fut.cancel()


def usage_chunk(obj: str, rid: str, model_name: str, prompt_tokens: int, choices) -> dict:
    """The last event when the request asked for usage (stream_options.include_usage)."""
    n = sum(c.done.num_generated for c in choices)
    return envelope(obj, rid, model_name, [], usage=P.usage(prompt_tokens, n))


def sse(events: AsyncIterator[dict | None], choices: Sequence[Choice], engine: Engine):
    """Server-sent events; an error mid-stream is sent as an error event. Sequences still
    running when the client goes away are cancelled.

    Events are written in one piece per `FLUSH` (the stream is about to wait for the engine),
    not one by one: a choice's last text, its finish, the usage and `[DONE]` are one write
    instead of four, and each write costs a pass through the ASGI stack and a system call on
    the event loop the whole server shares.
    """

    async def body():
        out = []
        try:
            try:
                async for ev in events:
                    if ev is not FLUSH:
                        out.append(f"data: {json.dumps(ev, ensure_ascii=False)}\n\n")
                    elif out:
                        yield "".join(out)
                        out = []
            except P.APIError as e:
                out.append(f"data: {json.dumps(e.body())}\n\n")
            except Exception as e:  # the response has started: the fault goes in the stream
                fault = errors.server_fault("internal error while streaming", e)
                out.append(f"data: {json.dumps(fault.body())}\n\n")
            out.append("data: [DONE]\n\n")
            yield "".join(out)
        finally:
            for c in choices:
                if c.done is None:
                    engine.cancel(c.seq)

    return StreamingResponse(body(), media_type="text/event-stream")
