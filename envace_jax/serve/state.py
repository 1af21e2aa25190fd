"""The server's state and the choice machinery every generating route shares.

One `ServerState` per application (on `app.state.server`) holds the engine, the tokenizer, the
prompt builder and the config; the route handlers are module-level functions that fetch it
with `server(request)`. A `Choice` is one generated answer: its engine sequence, the text it
has produced, and the queue the engine's thread fills with its events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import weakref
import zlib
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from envace_jax.sampling.distributions import SamplingParams
from envace_jax.serve import errors
from envace_jax.serve import protocol as P
from envace_jax.serve.batcher import Engine
from envace_jax.serve.config import ServerConfig
from envace_jax.serve.prompts import Prompts
from envace_jax.serve.sequences import Done, Tokens
from envace_jax.serve.sequences import Sequence as EngineSeq
from envace_jax.serve.text_stream import ChoiceText

log = logging.getLogger("envace_jax.serve")


@dataclasses.dataclass(eq=False)
class Choice:
    seq: EngineSeq
    text: ChoiceText
    queue: asyncio.Queue
    done: Done | None = None
    prefix: str = ""  # forced start of the reply (tool_choice), part of the prompt


@dataclasses.dataclass
class ServerState:
    """What the handlers share. names: the model ids requests may use; created: the model
    card's creation time."""

    engine: Engine
    tokenizer: Any
    config: ServerConfig
    prompts: Prompts
    names: frozenset[str]
    created: int
    # Choices whose requests are running (`abort_all` ends them at a forced shutdown).
    live: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)
    closing: bool = False  # a forced shutdown began: no new choices
    # `response_format` compiler (`structured.StructuredOutput`); None: structured output is
    # refused.
    structured: Any = None

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise P.APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_rows(self, prompts: int, n: int, param: str) -> None:
        """A 400 before any work when `prompts` x `n` rows exceed the limit per request."""
        limit = self.config.limits.max_rows_per_request
        if prompts * n > limit:
            what = f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"
            raise P.APIError(
                400,
                f"{param}: the request asks for {prompts * n} rows ({what}); this server takes "
                f"at most {limit} rows per request (--max-rows-per-request)",
                param=param,
                code="too_many_rows",
            )

    async def start_choices(self, rows, sampling, n, make_text, prefix="", seed=None, grammar=None):
        """Queues `n` choices for each (prompt ids, max new tokens) of `rows`, sampled with
        `sampling` (`seed`: each choice gets a seed of its own from it; `grammar`: a
        `structured.CompiledGrammar` every choice decodes under, with a matcher of its own).
        The per-row setup runs on a worker thread, not on the event loop."""
        aloop = asyncio.get_running_loop()
        args = (aloop, rows, sampling, n, make_text, prefix, seed, grammar)
        choices = await self.prompts.off_loop(self._start_choices, *args)
        self.live.update(choices)
        if self.closing:  # a forced shutdown began while they were being set up
            self.abort(choices)
        return choices

    def _start_choices(self, aloop, rows, sampling, n, make_text, prefix, seed, grammar):
        if self.closing:
            raise errors.shut_down()
        choices = []
        for prompt, max_new in rows:
            for _ in range(n):
                queue: asyncio.Queue = asyncio.Queue()

                def on_event(ev, queue=queue):
                    aloop.call_soon_threadsafe(queue.put_nowait, ev)

                row = sampling if seed is None else choice_sampling(sampling, seed, len(choices))
                seq = EngineSeq(tuple(prompt), max_new, row, on_event)
                if grammar is not None:
                    seq.grammar = grammar.new()
                choices.append(Choice(seq, make_text(), queue, prefix=prefix))
        try:
            for c in choices:
                self.engine.submit(c.seq)
        except RuntimeError as e:
            for c in choices:
                self.engine.cancel(c.seq)
            raise P.APIError(503, str(e), type="server_error", code="shutting_down") from e
        return choices

    def abort(self, choices) -> None:
        """Ends running choices as the forced shutdown does: their rows are cancelled and
        their requests answered with `errors.shut_down` (a stream: as its last event)."""
        for c in list(choices):
            if c.done is None:
                self.engine.cancel(c.seq)
                c.queue.put_nowait(Done("shutdown", len(c.text.ids)))

    def abort_all(self) -> None:
        """The forced shutdown (`--graceful-timeout` is over): no new choices, and every
        running one is ended."""
        self.closing = True
        self.abort(self.live)

    async def pump(self, choice: Choice) -> bool:
        """Waits for the next engine events of a choice and takes all that are queued (a row's
        last tokens and its end come together: one wake-up, one write); False once done."""
        if choice.done is not None:
            return False
        ev = await choice.queue.get()
        while isinstance(ev, Tokens):
            choice.text.add(ev.ids, ev.logprobs)
            if choice.text.stopped:
                self.engine.cancel(choice.seq)  # a stop sequence: no more tokens needed
            if choice.queue.empty():
                return True
            ev = choice.queue.get_nowait()
        choice.done = ev
        if ev.finish_reason == "error":
            raise errors.server_fault("generation failed", ev.error)
        if ev.finish_reason == "shutdown":
            raise errors.shut_down()
        return False

    async def run_all(self, choices: list[Choice], request: Request) -> bool:
        """Runs the choices to their end; False if the client disconnected first (the rows
        are then cancelled, and one quiet line logged)."""
        # One task per choice, not a gather: a cancelled gather keeps a CancelledError no one
        # retrieves, which asyncio logs with a traceback at every hang-up.
        work = [asyncio.ensure_future(self._drain(c)) for c in choices]
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while not all(t.done() for t in work):
                await asyncio.wait((*work, gone), return_when=asyncio.FIRST_COMPLETED)
                for t in work:
                    if t.done():
                        t.result()  # raises what the choice raised
                if gone.done() and not all(t.done() for t in work):
                    log.info("client disconnected; %d row(s) cancelled", len(choices))
                    return False
            return True
        finally:
            for task in (*work, gone):
                task.cancel()
            for t in work:  # retrieved: a second choice's error is not logged as unhandled
                if t.done() and not t.cancelled():
                    t.exception()
            for c in choices:
                if c.done is None:
                    self.engine.cancel(c.seq)

    async def _drain(self, choice: Choice) -> None:
        while await self.pump(choice):
            pass


def choice_sampling(sampling: SamplingParams, seed: int, index: int) -> SamplingParams:
    """The sampling of choice `index` of a request with `seed`: a seed of its own, so that the
    n choices differ from each other, and each is the same in any batch (the sampler draws a
    seeded row's noise from its seed and position alone)."""
    return dataclasses.replace(sampling, seed=zlib.crc32(f"{seed}/{index}".encode()))


def server(request: Request, req=None) -> ServerState:
    """The state of the application serving `request`; given the parsed body `req` of a
    generation request, once its model and parameters are checked."""
    state = request.app.state.server
    if req is not None:
        state.check_model(req.model)
        check_supported(req)
    return state


def envelope(obj: str, rid: str, model_name: str, choices: list, **more) -> dict:
    """A response or stream event of OpenAI's shape: id, object, created, model, choices, and
    `more` (usage)."""
    return {
        "id": rid,
        "object": obj,
        "created": P.now(),
        "model": model_name,
        "choices": choices,
        **more,
    }


def check_supported(req) -> None:
    bad = req.unsupported()
    if bad:
        field, why = bad[0]
        raise P.APIError(400, f"{field}: {why}", param=field, code="unsupported_value")


def finish_reason(c: Choice) -> str:
    if c.text.stopped:
        return "stop"
    return {"cancelled": "stop"}.get(c.done.finish_reason, c.done.finish_reason)


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read by then, so the
    connection's next message is its end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# The answer to a client that disconnected before its answer was ready (no one reads it).
GONE = Response(status_code=499)
