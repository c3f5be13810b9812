"""The FastAPI app: its routers (server/routes/), the error handlers, in-flight accounting, and the edge in front of
it all (server/edge.py: request ids, the key checked from the headers, the key's share, the body's bounds).

Lifecycle: the app answers at once; each model's engine loads in a background thread (``/ready`` is 503, and
``/v1/*`` for that model, until it is up: server/fleet.py). ``begin_drain`` turns ``/ready`` and new ``/v1/*``
requests to 503 while the requests in flight finish.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tokenmill.config import EngineConfig
from tokenmill.server.deps import ServerState
from tokenmill.server.edge import BodyLimits, KeyGate, RequestIds
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.openapi import install_openapi
from tokenmill.server.routes import anthropic, health, openai, responses, tokenize, usage

log = logging.getLogger(__name__)

__all__ = ["ServerState", "build_app"]


class InFlight:
    """ASGI middleware counting /v1/ requests until their last response byte (streams included)."""

    def __init__(self, app: Any):
        self.app = app
        self.count = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


class RateLimitHeaders:
    """ASGI middleware: every response to a key with rate limits carries OpenAI's ``x-ratelimit-*`` headers (its
    buckets as the response starts, so after this request's own charge; server/tenants.py)."""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: dict) -> None:
            key_name = scope.get("state", {}).get("key_name")
            if message["type"] == "http.response.start" and key_name:
                extra = self.state.tenants.headers(key_name)
                present = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = list(message.get("headers", [])) + [
                    (k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in present]
            await send(message)
        await self.app(scope, receive, send_with_headers)


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def build_app(state: ServerState, config: EngineConfig) -> RequestIds:
    """The ASGI app to serve: the FastAPI app wrapped in in-flight accounting (kept as state.in_flight) and the edge.
    Its models start loading (on threads of their own) once the app is up."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.fleet.start()
        yield

    app = FastAPI(title="tokenmill", version=_version(), lifespan=lifespan)
    app.state.tokenmill = state
    install_error_handlers(app)
    install_openapi(app)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    for router in (health.router, openai.router, responses.router, anthropic.router, tokenize.router, usage.router):
        app.include_router(router)
    state.in_flight = InFlight(RateLimitHeaders(app, state))
    body = BodyLimits(state.in_flight, config.max_request_body_bytes, config.body_read_timeout_s, config.max_json_depth)
    return RequestIds(KeyGate(body, state.auth, state.tenants, state.auth_all_endpoints))
