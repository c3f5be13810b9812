"""What every request meets at the edge, before any route reads it (ASGI middleware, outermost first):

1. ``RequestIds``: a fresh id per request (``x-request-id`` on every response); errors and log lines name it.
2. ``KeyGate``: the API key checked from the headers alone, so a caller without a valid key costs a header lookup and
   a 401, never a body read or a JSON parse; then, for an API path, the key's share before any work is done for it
   (server/tenants.py ``enter``: its request rate, its token bucket not empty, its cap on requests at once -- a 429
   with Retry-After; refused requests count), and the work done for it queues under its name (tokenmill/fair.py).
   Open without a key (unless ``auth_all_endpoints``): /health, /ready, /metrics, /openapi.json and the docs.
3. ``BodyLimits``: the body read whole before the app sees it, bounded in size (400), read time (408) and nesting
   depth (400), and refused when it holds a lone surrogate (400: no character, and no text any tokenizer, log or
   response can carry), so that no route parses what it should have refused.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, Callable

import numpy as np

from tokenmill.fair import caller
from tokenmill.server.auth import Authenticator
from tokenmill.server.errors import APIError, bad_request, new_request_id
from tokenmill.server.tenants import Tenants

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def is_api_path(path: str) -> bool:
    """A path whose requests count against a key's rates (the /v1 APIs and vLLM's /tokenize, /detokenize)."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


async def _refuse(error: APIError, scope: dict, receive: Callable, send: Callable) -> None:
    await error.response(scope.get("path", ""))(scope, receive, send)


class RequestIds:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = (b"x-request-id", new_request_id().encode())

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)
        await self.app(scope, receive, send_with_id)


class KeyGate:
    def __init__(self, app: Any, auth: Authenticator, tenants: Tenants, auth_all_endpoints: bool):
        self.app, self.auth, self.tenants, self.auth_all_endpoints = app, auth, tenants, auth_all_endpoints

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or (
                path in OPEN_PATHS and not self.auth_all_endpoints):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        try:
            name = self.auth.check(_header(headers, b"authorization"), _header(headers, b"x-api-key"))
        except APIError as error:
            return await _refuse(error, scope, receive, send)
        state = scope.setdefault("state", {})
        state["key_name"], state["key_checked"] = name, True
        caller.set(name)  # the work done for this request queues under its key (tokenmill/fair.py)
        if not is_api_path(path):
            return await self.app(scope, receive, send)
        try:
            self.tenants.enter(name)
        except APIError as error:
            return await _refuse(error, scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.tenants.leave(name)


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value is not None else None


class BodyLimits:
    """A body over ``max_bytes`` is a 400 and one not received within ``read_timeout_s`` a 408, both before it is
    parsed, whether the client announced its length or streamed it in chunks; JSON nested deeper than ``max_depth``
    is a 400. The body is then handed on whole."""

    def __init__(self, app: Any, max_bytes: int, read_timeout_s: float, max_depth: int):
        self.app, self.limit, self.read_timeout_s, self.max_depth = app, max_bytes, read_timeout_s, max_depth

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _refuse(self._too_large(), scope, receive, send)
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.read_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                error = APIError(408, f"the request body was not received within {self.read_timeout_s:g} s",
                                 "invalid_request_error", code="request_timeout")
                return await _refuse(error, scope, receive, send)
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await _refuse(self._too_large(), scope, receive, send)
        body, replayed = b"".join(chunks), False
        if json_depth(body, self.max_depth) > self.max_depth:
            error = bad_request(f"the request body nests arrays and objects more than {self.max_depth} deep",
                                code="nested_too_deeply")
            return await _refuse(error, scope, receive, send)
        if has_lone_surrogate(body):
            error = bad_request("the request body holds a lone UTF-16 surrogate (U+D800 to U+DFFF), which is no "
                                "character: send text as UTF-8, or a surrogate pair", code="invalid_text")
            return await _refuse(error, scope, receive, send)

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return bad_request(f"the request body is larger than this server's limit of {self.limit} bytes",
                           code="request_too_large")


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPENS, _CLOSES = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(body: bytes, bound: int) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings aside), or a number no larger
    than ``bound`` when the text has too few brackets to nest deeper (then nothing is scanned)."""
    if body.count(b"[") + body.count(b"{") <= bound:
        return 0
    codes = np.frombuffer(_JSON_STRING.sub(b'""', body), np.uint8)
    steps = np.isin(codes, _OPENS).astype(np.int32) - np.isin(codes, _CLOSES).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")  # a surrogate encoded as if it were a character: never UTF-8
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def has_lone_surrogate(body: bytes) -> bool:
    """A JSON text that decodes to a string holding a surrogate not paired as UTF-16 pairs them (Python's JSON reader
    takes both spellings). Escapes are read in full only when one looks like a surrogate (pairs are common: emoji)."""
    if _RAW_SURROGATE.search(body):
        return True
    if not _ESCAPED_SURROGATE.search(body):
        return False
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except ValueError:
        return False  # not JSON: the route says so
    return False
