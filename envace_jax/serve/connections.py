"""The connection layer: uvicorn's h11 protocol with the server's connection limits (`limits`).

uvicorn times a connection out only between two requests (keep-alive). A client that opens a
connection and sends part of a request head, or nothing, held its socket for ever: a thousand
of them were never closed, and 300 exhausted a 300-file limit, after which `/health` could not
be reached and asyncio logged a traceback for every failed accept (340 MB in 100 s). Here:

* a request head must arrive within `header_timeout` seconds of the connection opening (or of
  the previous response): otherwise the connection is answered 408 and closed;
* at most `max_connections` connections are open (`effective_max_connections` lowers the limit
  to what the open-files limit leaves room for, so that accept() itself never runs out). One
  more makes room by closing the connection that has waited longest for a request head: idle
  connections cannot lock out clients that send requests (`/health` answers through a flood of
  them). When every connection is busy with a request, the new one is answered 503 and closed
  at once, so its file descriptor is free again;
* refusals and failed accepts are logged at most once every few seconds, with a count;
* the event loop accepts at most `ACCEPTS_PER_TICK` connections per turn (`PacedEventLoop`):
  asyncio accepts up to the listen backlog (2048) in one go and only then lets the new
  connections' protocols run, so a flood took every file descriptor before one of them could be
  closed, and accepting stopped for a second at a time (the `/health` of a client waited 5 s).

The body's own deadline (`body_timeout`) is enforced where the body is read (`middleware`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import time
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from envace_jax.serve import protocol as P
from envace_jax.serve.limits import Limits

log = logging.getLogger("envace_jax.serve")

# File descriptors kept free for everything but client connections (the model's files, the
# engine's threads, logs, the listening socket).
FD_RESERVE = 64
ACCEPTS_PER_TICK = 16  # well under FD_RESERVE: accepted connections not yet seen by a protocol
_LOG_EVERY_S = 10.0


def _raw_response(status: int, phrase: str, message: str, kind: str, code: str) -> bytes:
    """A complete JSON error response that closes the connection, in bytes."""
    body = json.dumps(P.error_body(message, kind, None, code)).encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Throttled:
    """Counts an event and logs it at most once every `_LOG_EVERY_S` seconds."""

    def __init__(self, what: str):
        self.what, self.count, self.last = what, 0, -_LOG_EVERY_S

    def note(self, detail: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= _LOG_EVERY_S:
            log.warning(
                "%s %d time(s) in the last %.0f s: %s",
                self.what,
                self.count,
                min(now - self.last, _LOG_EVERY_S),
                detail,
            )
            self.count, self.last = 0, now


class GuardedH11(H11Protocol):
    """H11Protocol with the head deadline and the connection limit (module docstring)."""

    LIMITS: ClassVar[Limits] = Limits()
    # Connections waiting for a request head, oldest first (a dict as an ordered set).
    WAITING: ClassVar[dict] = {}
    REFUSED: ClassVar[_Throttled] = _Throttled("refused a connection")
    EVICTED: ClassVar[_Throttled] = _Throttled("closed an idle connection to make room")
    _head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        limit = self.LIMITS.max_connections
        if len(self.connections) > limit:
            oldest = next(iter(self.WAITING), None)
            detail = f"{len(self.connections) - 1} connections open, the limit is {limit}"
            if oldest is None:
                self.REFUSED.note(detail + ", all busy")
                self._close_with(transport, 503, "server_error", "too_many_connections")
                return
            self.EVICTED.note(detail)
            oldest._disarm()
            oldest._close_with(oldest.transport, 503, "server_error", "too_many_connections")
        self._arm()

    def _close_with(self, transport, status: int, kind: str, code: str) -> None:
        if status == 503:
            phrase = "Service Unavailable"
            message = (
                f"the server is at its limit of {self.LIMITS.max_connections} open connections; "
                "a connection that sends no request is closed to make room: retry later"
            )
        else:
            phrase = "Request Timeout"
            message = (
                f"no complete request head within {self.LIMITS.header_timeout:g} s; "
                "closing the connection"
            )
        transport.write(_raw_response(status, phrase, message, kind, code))
        transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
            self._disarm()  # the head is in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()  # the next request's head

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.LIMITS.header_timeout, self._head_late)
        self.WAITING[self] = None

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self.WAITING.pop(self, None)

    def _head_late(self) -> None:
        self._disarm()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._close_with(self.transport, 408, "invalid_request_error", "request_timeout")


def guarded_protocol(limits: Limits) -> type[GuardedH11]:
    """The protocol class uvicorn's `http=` takes, enforcing `limits` (a class per server: it
    holds the server's waiting connections)."""
    state = {
        "LIMITS": limits,
        "WAITING": {},
        "REFUSED": _Throttled("refused a connection"),
        "EVICTED": _Throttled("closed an idle connection to make room"),
    }
    return type("GuardedH11", (GuardedH11,), state)


def effective_max_connections(limit: int) -> tuple[int, str | None]:
    """`limit`, or less where the open-files limit leaves less room (after raising the soft
    limit towards the hard one); with a warning saying so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = FD_RESERVE
    need = limit + used + FD_RESERVE
    if soft == resource.RLIM_INFINITY or need <= soft:
        return limit, None
    if hard == resource.RLIM_INFINITY or need <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return limit, None
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    room = max(1, soft - used - FD_RESERVE)
    return room, (
        f"--max-connections {limit} lowered to {room}: the open-files limit is {soft} and "
        f"{used} files are open (raise it with `ulimit -n`)"
    )


class _AcceptErrors(logging.Filter):
    """asyncio logs a failed accept() (e.g. out of file descriptors) with a traceback each
    time it retries: kept to one line every `_LOG_EVERY_S` seconds."""

    def __init__(self):
        super().__init__()
        self.throttle = _Throttled("accept() failed")

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        self.throttle.note(str(error or record.getMessage()))
        return False


def quiet_accept_errors() -> None:
    """Installs the filter on asyncio's logger (once)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AcceptErrors) for f in logger.filters):
        logger.addFilter(_AcceptErrors())


class PacedEventLoop(asyncio.SelectorEventLoop):
    """asyncio's event loop, accepting at most ACCEPTS_PER_TICK connections per turn (module
    docstring). The listen backlog itself stays large: connections wait in the kernel's queue,
    not in dropped SYNs."""

    def _accept_connection(
        self, protocol_factory, sock, sslcontext=None, server=None, backlog=100, *rest
    ):
        return super()._accept_connection(
            protocol_factory, sock, sslcontext, server, min(backlog, ACCEPTS_PER_TICK), *rest
        )


def run(main) -> None:
    """`asyncio.run(main)` on a `PacedEventLoop`."""
    if hasattr(asyncio, "Runner"):  # Python 3.11+
        with asyncio.Runner(loop_factory=PacedEventLoop) as runner:
            runner.run(main)
        return
    loop = PacedEventLoop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
