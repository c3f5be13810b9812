"""The FastAPI dependencies every route shares: the server's state and the caller's key. Which model serves a
request is the router's (server/routing.py): ``state.router.serve(body, key_name, attempt)``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Depends, Header, Request

from tokenmill.server.auth import Authenticator
from tokenmill.server.errors import APIError
from tokenmill.server.fleet import Fleet
from tokenmill.server.ledger import UsageLedger
from tokenmill.server.metrics import Metrics
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.routing import Router
from tokenmill.server.serving import ServerContext
from tokenmill.server.tenants import Tenants


class ServerState:
    """What lives as long as the server: auth, the models (``fleet``) and the services they share (metrics, the
    keys' limits, stored responses), the drain flag."""

    def __init__(self, authenticator: Authenticator, auth_all_endpoints: bool, fleet: Fleet, metrics: Metrics,
                 tenants: Tenants, responses: ResponseStore, ledger: UsageLedger | None = None):
        self.auth = authenticator
        self.auth_all_endpoints = auth_all_endpoints
        self.fleet, self.metrics, self.tenants, self.responses = fleet, metrics, tenants, responses
        self.ledger = ledger
        self.router = Router(fleet, tenants)
        self.draining = False
        self.in_flight: Any = None  # server/app.py's InFlight, counting /v1/ requests until their last byte
        self.created = int(time.time())

    @property
    def ctx(self) -> ServerContext | None:
        """The default model's context while it serves."""
        return self.fleet.default.ctx

    @property
    def load_error(self) -> BaseException | None:
        """Why a lone model failed (to load, or its engine): the server then exits. A model of several that fails
        is restarted, or stops the server through ``on_fatal`` (server/launch.py)."""
        return next((h.error for h in self.fleet.hosts if not h.on_demand and h.status == "failed"
                     and h.ctx is None and not h.restart), None)

    def serving(self) -> "ServerState":
        if self.draining:
            raise APIError(503, "The server is shutting down.", "service_unavailable_error")
        return self


def server_state(request: Request) -> ServerState:
    return request.app.state.tokenmill


def api_key(request: Request, state: ServerState = Depends(server_state), authorization: str | None = Header(None),
            x_api_key: str | None = Header(None)) -> str | None:
    """The caller's key name (None when auth is off), as the edge checked it (server/edge.py); a 401 for a missing or
    wrong key. Kept in the request's state for the rate-limit headers of its response (server/app.py)."""
    if request.scope.get("state", {}).get("key_checked"):
        return request.state.key_name
    request.state.key_name = name = state.auth.check(authorization, x_api_key)
    return name


def operator_key(state: ServerState = Depends(server_state), authorization: str | None = Header(None),
                 x_api_key: str | None = Header(None)) -> None:
    """/health, /ready and /metrics: open, unless auth_all_endpoints asks for a key there too."""
    if state.auth_all_endpoints:
        state.auth.check(authorization, x_api_key)


def serving_state(state: ServerState = Depends(server_state), _: str | None = Depends(api_key)) -> ServerState:
    """The server while it takes requests (after the key check: an unknown caller learns nothing of the server)."""
    return state.serving()
