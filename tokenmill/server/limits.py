"""Bounds on one request's size, each a clear 400 naming the parameter. The bounds are defined once, as EngineConfig's
``max_*`` server fields, and read from there. They keep one request from costing the server out of proportion: a
long stop string sets the detokenizer's hold-back and is searched every step; logit_bias and stop_token_ids are
applied per step; n and prompt lists multiply everything; a body is read into memory before it is parsed."""

from __future__ import annotations

from typing import Any, Callable

from tokenmill.config import EngineConfig
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import CompletionRequest, SamplingFields


def _at_most(value: int, limit: int, param: str, what: str) -> None:
    if value > limit:
        raise bad_request(f"{what}: {value} given, at most {limit} allowed on this server", param=param,
                          code="limit_exceeded")


def check_limits(body: SamplingFields, limits: EngineConfig) -> None:
    _at_most(body.n, limits.max_n, "n", "n (choices per prompt)")
    stop = body.stop or []
    _at_most(len(stop), limits.max_stop_sequences, "stop", "number of stop sequences")
    _at_most(max((len(s) for s in stop), default=0), limits.max_stop_length, "stop",
             "characters in a stop sequence")
    _at_most(len(body.logit_bias or {}), limits.max_logit_bias, "logit_bias", "logit_bias entries")
    _at_most(len(body.stop_token_ids or []), limits.max_stop_token_ids, "stop_token_ids", "stop_token_ids entries")
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) and body.prompt \
            and not isinstance(body.prompt[0], int):
        _at_most(len(body.prompt), limits.max_prompts, "prompt", "prompts in one request")
    _at_most(len(getattr(body, "tools", None) or []), limits.max_tools, "tools", "tools")


class BodySizeLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered with a 400 before it is parsed, whether the
    client announced its length or streamed it in chunks (then it is read here, at most limit + 1 bytes, and handed
    on whole)."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._refuse(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        error = bad_request(f"the request body is larger than this server's limit of {self.limit} bytes",
                            code="request_too_large")
        await error.response(scope.get("path", ""))(scope, receive, send)
