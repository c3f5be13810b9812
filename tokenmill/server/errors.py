"""Errors as OpenAI-shaped data: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Tenants get an error's kind and the request's id (the ``x-request-id`` header of every response, server/edge.py);
exception text, paths and stack traces go to the operator's log only, under that id."""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


# The id of the HTTP request being served (set at the edge, server/edge.py; read wherever an error or log names it).
_request_id: ContextVar[str | None] = ContextVar("tokenmill_request_id", default=None)


def new_request_id() -> str:
    """A fresh id for an HTTP request, made current for the task serving it (and the tasks it starts)."""
    rid = f"req_{uuid.uuid4().hex}"
    _request_id.set(rid)
    return rid


def request_id() -> str:
    """The current HTTP request's id ("-" outside one)."""
    return _request_id.get() or "-"


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, fallback: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers
        # The model refused for want of capacity (admission full, loading, dead): a route may try its fallbacks.
        self.fallback = fallback

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's shape, for /v1/messages: ``{"type": "error", "error": {"type", "message"}}``."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = f"{self.param}: {self.message}" if self.param and not self.message.startswith(self.param) \
            else self.message
        return {"type": "error", "error": {"type": kind, "message": message}}

    def response(self, path: str = "") -> JSONResponse:
        """OpenAI's shape, or Anthropic's for a request to its API (``path`` under /v1/messages)."""
        anthropic = path.startswith("/v1/messages")
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status,
                            headers=self.headers)


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _validation_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s: unhandled error", request_id())
        return APIError(500, f"The server had an error while processing your request (request id {request_id()}).",
                        "server_error").response(request.url.path)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}")
    param = _validation_param(tuple(first.get("loc", ())))
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # OpenAI's words for a field it does not know
        names = ", ".join(str(e["loc"][-1]) for e in unknown)
        param = _validation_param(tuple(unknown[0]["loc"]))
        return bad_request(f"Unrecognized request argument supplied: {names}", param=param)
    message = "; ".join(f"{_validation_param(tuple(e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5])
    return bad_request(message, param=param)
