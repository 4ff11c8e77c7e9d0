"""The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``, and the
one exception every route raises to answer with it.

The OpenAI SDK turns the status into its exception class (400 ``BadRequestError``, 401
``AuthenticationError``, 404 ``NotFoundError``, 429 ``RateLimitError``, 5xx
``InternalServerError``) and reads ``message`` / ``param`` / ``code`` from the body.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from producers.errors import (
    ContextLengthExceeded,
    InvalidJobFailed,
    JobCancelled,
    JobError,
    JobExpired,
    JobNotFound,
)
from producers.openai_format import Endpoint, error_param
from producers.protocol.limits import abbreviate

log = logging.getLogger("sluiceway.gateway")

# status -> the OpenAI error type a client sees for it
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An answer other than success: its HTTP status and the envelope's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        message, param = sendable(message), sendable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class InvalidRequest(APIError):
    """400: the request breaks a rule; ``param`` names the field (``messages.2.content``)."""

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(400, message, param=param, code=code)


def sendable(text: str | None) -> str | None:
    """``text`` with each lone UTF-16 surrogate written as its escape (``\\ud800``): a JSON body may
    name a field or hold a value that way, which no UTF-8 response can carry (it was a
    UnicodeEncodeError, a 500, instead of the envelope)."""
    if text is None or _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The envelope itself."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_value(param: str, value: Any, rule: str) -> InvalidRequest:
    """400 naming the field, its value (abbreviated) and the rule it breaks."""
    return InvalidRequest(param, f"{param}: {rule}, got {abbreviate(value)}", code="invalid_value")


def timeout_error(seconds: float) -> APIError:
    """504: the request outlived ``request_timeout`` (its job is cancelled)."""
    return APIError(504, f"the request did not finish within {seconds:g}s (request_timeout); its job was"
                         " cancelled", code="timeout")


def job_error(exc: JobError | JobNotFound, endpoint: Endpoint) -> APIError:
    """How a job that ended without a result is answered: bad input 400 (``invalid_job``,
    ``context_length_exceeded``, its ``param`` the field the worker named), expired 504,
    cancelled 409, anything else 500."""
    if isinstance(exc, JobNotFound):
        return APIError(500, f"the job's record vanished: {exc}", code="job_not_found")
    detail = exc.error or exc.status
    if isinstance(exc, (InvalidJobFailed, ContextLengthExceeded)):
        return InvalidRequest(error_param(detail, endpoint), detail, code=exc.code)
    if isinstance(exc, JobExpired):
        return APIError(504, f"the request expired before it finished: {detail}", code=exc.code)
    if isinstance(exc, JobCancelled):
        return APIError(409, f"the request was cancelled: {detail}", code=exc.code, type="cancelled")
    return APIError(500, f"the request failed: {detail}", code=exc.code or "engine_error")


def unexpected_error(exc: Exception) -> APIError:
    """A fault of the gateway or of Redis: 503 when Redis is unreachable or full, else 500."""
    import redis

    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)):
        return APIError(503, f"redis unavailable: {type(exc).__name__}: {abbreviate(str(exc), 200)}",
                        code="redis_unavailable", headers={"Retry-After": "1"})
    return APIError(500, f"internal error: {type(exc).__name__}: {abbreviate(str(exc), 200)}", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can raise answers with the envelope, never FastAPI's ``detail``."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    # NOTE: an exception no handler above takes is answered by AnswerUnexpected, not by an
    # exception handler for Exception (Starlette's last resort, which drops the connection)
    app.add_middleware(AnswerUnexpected)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()


def validation_error(errors: Sequence[Any]) -> InvalidRequest:
    """The 400 of a pydantic validation's errors (a route's query, or a body read into a model), naming the
    first one's field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid request"))
    return InvalidRequest(param, message)


class AnswerUnexpected:
    """Answers an exception no handler took (a 503 while Redis is away, a 500) and keeps the
    connection: Starlette's last-resort handler sends the same answer, then raises again to the
    server, which drops the connection, so a client's next request on it was reset (every other
    request of a keep-alive client during a Redis outage). A response already begun (a stream)
    cannot be answered again: its exception goes on to the server."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            error = unexpected_error(exc)
            if error.status == 503:  # Redis away: one line a request, not a traceback each
                log.warning("%s %s: %s", scope.get("method"), scope.get("path"), error.message)
            else:
                log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await error.response()(scope, receive, send)
