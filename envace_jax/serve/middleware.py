"""Plain ASGI layers in front of the application: the body's size and time limits and the API
key.

Plain ASGI rather than FastAPI's `@app.middleware('http')`, whose BaseHTTPMiddleware relays
every streamed chunk through an extra task and memory stream: that costs CPU on the event loop
for each SSE event of each client, which the decode loop competes with.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from envace_jax.serve import protocol as P


async def send_json(send, status: int, body: dict, headers=()) -> None:
    """One complete JSON response. ASCII-escaped: an error may quote request text, and a lone
    surrogate in it must not make the answer itself fail to encode."""
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """Refuses request bodies over `limit` bytes with 413 (by Content-Length up front, or by
    counting a chunked body as it arrives), and bodies not received within `timeout` seconds
    with 408 (a client that sends a head and then nothing, or a trickle, held its connection
    for ever).

    The body is read here, whole, before the application runs, and handed to it from memory: the
    application parses all of it anyway, and an over-long body then never reaches it (a limit
    enforced inside the application's own read would surface as its parse error, a 400).
    """

    def __init__(self, app, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left before the end
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.limit:
                        return await self._refuse(send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} s"
            body = P.error_body(message, "invalid_request_error", code="request_timeout")
            return await send_json(send, 408, body, [(b"connection", b"close")])
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        del chunks

        async def replay():
            # The body once (not kept: a stream may live long), then the connection's own
            # messages (a disconnect, for the application to notice).
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send):
        await send_json(
            send,
            413,
            P.error_body(
                f"request body exceeds the limit of {self.limit} bytes",
                "invalid_request_error",
                code="request_too_large",
            ),
        )


class ApiKey:
    """Every request but `GET /health` needs `Authorization: Bearer KEY` (401 otherwise):
    `/openapi.json` too, which describes the API to whoever asks."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return await send_json(
                    send,
                    401,
                    P.error_body(
                        "missing or invalid API key (send Authorization: Bearer KEY)",
                        "authentication_error",
                        code="invalid_api_key",
                    ),
                )
        return await self.app(scope, receive, send)
