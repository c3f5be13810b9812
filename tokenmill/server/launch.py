"""``tokenmill serve``: uvicorn with a SIGTERM that drains.

On SIGTERM: /ready and new /v1 requests turn 503, requests in flight get up to ``shutdown_timeout`` seconds
to finish, then uvicorn shuts down and the process exits 0. A second SIGTERM, or SIGINT, stops at once. The engine
process never outlives this one (engine/process.py); after a drain that timed out it is killed at once.

A model that fails to load is logged, uvicorn shuts down, and the process exits 1 within seconds.

When the engine of a lone model fails (its process or a tensor-parallel rank dies), requests in flight get errors at
once, /ready, /health and new requests 503, and ``ENGINE_FAILURE_EXIT_DELAY`` seconds later the process exits 1, so
that its supervisor (docker's restart policy, systemd, Kubernetes) starts a fresh one. In a server of several models
(``[[models]]``) the others keep serving and the failed one is restarted in place (server/fleet.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
import threading
import time
from typing import Callable

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineClient
from tokenmill.logs import configure_logging, one_line
from tokenmill.server.admission import Admission
from tokenmill.server.app import ServerState, build_app
from tokenmill.server.auth import authenticator_for
from tokenmill.server.fleet import Fleet, LoadContext, ModelHost
from tokenmill.server.fleet_plan import model_configs
from tokenmill.server.tenants import Tenants
from tokenmill.server.ledger import UsageLedger
from tokenmill.server.metrics import Metrics
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.serving import ServerContext
from tokenmill.tools.formats import detect_format
from tokenmill.tools.reasoning import detect_reasoning

log = logging.getLogger(__name__)

# Seconds a server whose engine failed keeps answering 503 (pollers and load balancers see why) before it exits 1.
ENGINE_FAILURE_EXIT_DELAY = 5.0
# Seconds the engine process gets to stop when asked, after a drain that finished, before it is killed.
ENGINE_STOP_TIMEOUT = 10.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.cut_off = False  # the drain timed out with requests still in flight
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining and self._loop is not None:
            self.state.draining = True
            log.info("SIGTERM: draining (up to %.0f s for requests in flight)", self.shutdown_timeout)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        in_flight = self.state.in_flight
        while in_flight is not None and in_flight.count > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if in_flight is not None and in_flight.count:
            log.warning("shutdown timeout: %d requests still in flight are cut off", in_flight.count)
            self.cut_off = True
        self.should_exit = True


def model_loader(metrics: Metrics, tenants: Tenants, responses: ResponseStore, ledger: UsageLedger | None
                 ) -> LoadContext:
    """Builds one model's context (its engine started, blocking) around the services every model shares."""
    def load(config: EngineConfig, on_failure: Callable[[BaseException], None]) -> ServerContext:
        client = EngineClient(config, in_process=not config.engine_process)
        client.on_failure = on_failure
        try:
            info = client.start()
        except BaseException:
            client.stop(timeout=0)
            raise
        admission = Admission(int(info.kv_capacity_tokens * config.admission_overcommit),
                              kv_tokens=info.kv_tokens_held)
        log.info("serving %s: KV cache %d tokens, admission limit %d promised tokens", info.model_name,
                 info.kv_capacity_tokens, admission.limit)
        tool_format = detect_format(client.chat_template, config.tool_call_parser)
        reasoning = detect_reasoning(client.chat_template, config.reasoning_parser)
        log.info("tool calls: %s format; reasoning: %s", tool_format.name, reasoning.name if reasoning else "none")
        pooling = info.pooling
        log.info("embeddings: %s", f"{pooling.mode} pooling{', normalized' if pooling.normalize else ''} "
                 f"({pooling.source})" if pooling.mode else f"not served ({pooling.refusal})")
        return ServerContext(client, metrics, info.model_name, config, admission, tool_format, reasoning, responses,
                             tenants, ledger)
    return load


def open_ledger(config: EngineConfig) -> UsageLedger | None:
    """The usage ledger, or None (logged) where it is off or its file cannot be written: serving goes on."""
    if not config.usage_db:
        return None
    try:
        return UsageLedger(config.usage_db, config.hourly_cost)
    except (OSError, sqlite3.Error) as exc:
        log.error("usage ledger off: cannot open %s (%s); set --usage-db to a writable path", config.usage_db, exc)
        return None


def build_state(config: EngineConfig, on_fatal: Callable[[ModelHost, BaseException], None]) -> ServerState:
    """The server's state: its models (one, or the [[models]] of the config, checked against the machine's memory
    first) and the services they share."""
    metrics, tenants = Metrics(per_key=config.metrics_per_key), Tenants(config.keys)
    responses = ResponseStore(config.responses_store_max_count, config.responses_store_max_bytes,
                              config.responses_store_max_count_per_key, config.responses_store_max_bytes_per_key,
                              config.responses_store_max_item_bytes)
    ledger = open_ledger(config)
    load = model_loader(metrics, tenants, responses, ledger)
    if not config.models:
        hosts = [ModelHost(None, (), config, load, metrics, on_fatal=on_fatal)]
    else:
        configs = model_configs(config)
        hosts = [ModelHost(spec.name, spec.aliases, model_config, load, metrics, on_demand=spec.load == "on_demand",
                           restart=True, on_fatal=on_fatal) for spec, model_config in zip(config.models, configs)]
    fleet = Fleet(hosts, config.routes, config.max_loaded_models, config.idle_unload_s, config.load_wait_s)
    return ServerState(authenticator_for(config), config.auth_all_endpoints, fleet, metrics, tenants, responses,
                       ledger)


def connection_limits(config: EngineConfig) -> dict:
    """uvicorn's bounds on what one client can hold before a request reaches the app: connections at once (503
    beyond), the request line and headers (h11, so that the bound applies whatever is installed), idle keep-alive."""
    return dict(http="h11", limit_concurrency=config.max_connections,
                h11_max_incomplete_event_size=config.max_header_bytes,
                timeout_keep_alive=max(1, round(config.keep_alive_timeout_s)))


def serve(config: EngineConfig) -> int:
    configure_logging(config.log_json)
    failures: list[BaseException] = []

    def model_failed(host: ModelHost, exc: BaseException) -> None:
        failures.append(exc)
        delay = ENGINE_FAILURE_EXIT_DELAY if host.served else 0.0
        log.error("%s (%s): exiting in %.0f s", "the engine failed" if host.served else "a model failed to load",
                  one_line(str(exc)), delay)
        threading.Timer(delay, lambda: setattr(server, "should_exit", True)).start()

    state = build_state(config, model_failed)
    asgi = build_app(state, config)
    uv_config = uvicorn.Config(asgi, host=config.host, port=config.port, log_config=None,
                               timeout_graceful_shutdown=1, access_log=False, **connection_limits(config))
    server = DrainingServer(uv_config, state, config.shutdown_timeout)
    log.info("listening on http://%s:%d", config.host, config.port)
    try:
        server.run()
    finally:  # after a drain that timed out, the engines are still busy: end them at once
        state.fleet.stop(timeout=0 if server.cut_off else ENGINE_STOP_TIMEOUT)
        if state.ledger is not None:
            state.ledger.close()
    return 1 if failures else 0
