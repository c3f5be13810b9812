"""The FastAPI dependencies every route shares: the server's state, the caller's key, a ready engine, the model."""

from __future__ import annotations

import time
from typing import Any, Callable

from fastapi import Depends, Header, Request

from tokenmill.server.auth import Authenticator
from tokenmill.server.errors import APIError
from tokenmill.server.serving import ServerContext


class ServerState:
    """What lives as long as the server: auth, the context once the engine is ready, the drain flag."""

    def __init__(self, authenticator: Authenticator, auth_all_endpoints: bool):
        self.auth = authenticator
        self.auth_all_endpoints = auth_all_endpoints
        self.ctx: ServerContext | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.in_flight: Any = None  # server/app.py's InFlight, counting /v1/ requests until their last byte
        self.created = int(time.time())
        # Called when the model fails to load: a server that can never be ready should exit, not linger.
        self.on_load_failure: Callable[[], None] = lambda: None

    def ready_context(self) -> ServerContext:
        if self.draining:
            raise APIError(503, "The server is shutting down.", "service_unavailable_error")
        if self.ctx is None:
            raise APIError(503, "The model is still loading.", "service_unavailable_error")
        if not self.ctx.client.healthy:
            raise APIError(503, f"The engine has failed ({self.ctx.client.error}); the server needs a restart.",
                           "service_unavailable_error")
        return self.ctx


def server_state(request: Request) -> ServerState:
    return request.app.state.tokenmill


def api_key(request: Request, state: ServerState = Depends(server_state), authorization: str | None = Header(None),
            x_api_key: str | None = Header(None)) -> str | None:
    """The caller's key name (None when auth is off); a 401 for a missing or wrong key. Kept in the request's state
    for the rate-limit headers of its response (server/app.py)."""
    request.state.key_name = name = state.auth.check(authorization, x_api_key)
    return name


def operator_key(state: ServerState = Depends(server_state), authorization: str | None = Header(None),
                 x_api_key: str | None = Header(None)) -> None:
    """/health, /ready and /metrics: open, unless auth_all_endpoints asks for a key there too."""
    if state.auth_all_endpoints:
        state.auth.check(authorization, x_api_key)


def ready_context(state: ServerState = Depends(server_state), _: str | None = Depends(api_key)) -> ServerContext:
    """The engine's context once it serves (after the key check: an unknown caller learns nothing of the server)."""
    return state.ready_context()


def check_model(ctx: ServerContext, model: str | None, key_name: str | None) -> None:
    """A 404 for a model this server does not serve, or that the caller's key may not use ([[keys]] models)."""
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", param="model",
                       code="model_not_found")
    ctx.tenants.check_model(key_name, ctx.model_name)
