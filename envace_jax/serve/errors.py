"""Error answers in OpenAI's format: `{"error": {message, type, param, code}}`.

A client's mistake is a 4xx whose message names the field. A server fault is a 500 that says
what failed and gives a request id, never the exception itself: the exception and its traceback
go to the server log under that id, once.
"""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from envace_jax.serve import protocol as P

log = logging.getLogger("envace_jax.serve")


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote request text, and a lone surrogate in it
    must not make the answer itself fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(status: int, message: str, type: str, param=None, code=None, headers=None):
    return AsciiJSONResponse(
        P.error_body(message, type, param, code), status_code=status, headers=headers
    )


def server_fault(what: str, detail: BaseException | str) -> P.APIError:
    """A 500 for a fault of the server: logged under a new request id, which the answer gives."""
    rid = "req-" + uuid.uuid4().hex[:16]
    if isinstance(detail, BaseException):
        log.error("request %s: %s", rid, what, exc_info=detail)
    else:
        log.error("request %s: %s: %s", rid, what, detail)
    return P.APIError(
        500,
        f"{what} (request id {rid}; the server log has the details)",
        type="server_error",
        code="internal_error",
    )


def shut_down() -> P.APIError:
    """The answer to a request still running when a forced shutdown ends it (503, with a
    request id under which the log names it)."""
    rid = "req-" + uuid.uuid4().hex[:16]
    log.warning("request %s: ended by the server's shutdown (--graceful-timeout is over)", rid)
    return P.APIError(
        503,
        f"the server shut down before this request finished (request id {rid})",
        type="server_error",
        code="shutting_down",
    )


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [f"[{x}]" if isinstance(x, int) else f".{x}" for x in err.get("loc", ())]
        where = "".join(x for x in loc if x != ".body").lstrip(".") or "body"
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            return f"request body is not valid JSON: {ctx}".strip(), None
        if err.get("type") == "extra_forbidden":
            parts.append(f"{where}: unknown field")
        elif err.get("type") == "missing":
            parts.append(f"{where}: field required")
        else:
            parts.append(f"{where}: {err.get('msg')}")
        param = param or where
    return "invalid request: " + "; ".join(parts), param


class GuardedRoute(APIRoute):
    """A route whose unexpected exceptions become `server_fault` answers. Caught here rather
    than by an app-wide handler, which Starlette calls and then re-raises to the server, so the
    traceback would be logged twice, once without the request id."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            try:
                return await handler(request)
            except (P.APIError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception as e:
                fault = server_fault("internal error", e)
                return error_response(fault.status, fault.message, fault.type, code=fault.code)

        return guarded


def install(app: FastAPI) -> None:
    """Error handlers of `app`; routes added after this are `GuardedRoute`s."""
    app.router.route_class = GuardedRoute

    @app.exception_handler(P.APIError)
    async def _on_api_error(request, exc: P.APIError):
        return AsciiJSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{exc.detail} ({request.method} {request.url.path})"
        return error_response(exc.status_code, message, kind)

    @app.exception_handler(Exception)
    async def _on_crash(request, exc: Exception):  # outside any route (a handler's own bug)
        fault = server_fault("internal error", exc)
        return error_response(fault.status, fault.message, fault.type, code=fault.code)
