"""``tokenmill serve``: uvicorn with a SIGTERM that drains.

On SIGTERM: /ready and new /v1 requests turn 503, requests in flight get up to ``shutdown_timeout`` seconds
to finish, then uvicorn shuts down and the process exits 0. A second SIGTERM, or SIGINT, stops at once. The engine
process never outlives this one (engine/process.py); after a drain that timed out it is killed at once.

A model that fails to load is logged, uvicorn shuts down, and the process exits 1 within seconds.

When the engine fails (its process or a tensor-parallel rank dies), requests in flight get errors at once, /ready,
/health and new requests 503, and ``ENGINE_FAILURE_EXIT_DELAY`` seconds later the process exits 1, so that its
supervisor (docker's restart policy, systemd, Kubernetes) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Callable

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineClient
from tokenmill.logs import configure_logging
from tokenmill.server.admission import Admission
from tokenmill.server.app import ServerState, build_app
from tokenmill.server.auth import authenticator_for
from tokenmill.server.tenants import Tenants
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


def _loader(config: EngineConfig, clients: list[EngineClient], on_failure: Callable[[BaseException], None]):
    def load() -> ServerContext:
        client = EngineClient(config, in_process=not config.engine_process)
        client.on_failure = on_failure
        clients.append(client)  # stopped at exit, also when it never became ready
        info = client.start()
        admission = Admission(int(info.kv_capacity_tokens * config.admission_overcommit),
                              kv_tokens=info.kv_tokens_held)
        log.info("serving %s: KV cache %d tokens, admission limit %d promised tokens", info.model_name,
                 info.kv_capacity_tokens, admission.limit)
        tool_format = detect_format(client.chat_template, config.tool_call_parser)
        reasoning = detect_reasoning(client.chat_template, config.reasoning_parser)
        log.info("tool calls: %s format; reasoning: %s", tool_format.name, reasoning.name if reasoning else "none")
        responses = ResponseStore(config.responses_store_max_count, config.responses_store_max_bytes)
        pooling = info.pooling
        log.info("embeddings: %s", f"{pooling.mode} pooling{', normalized' if pooling.normalize else ''} "
                 f"({pooling.source})" if pooling.mode else f"not served ({pooling.refusal})")
        return ServerContext(client, Metrics(client, admission, info.model_name), info.model_name, config, admission,
                             tool_format, reasoning, responses, Tenants(config.keys))
    return load


def serve(config: EngineConfig) -> int:
    configure_logging(config.log_json)
    state = ServerState(authenticator_for(config), config.auth_all_endpoints)
    clients: list[EngineClient] = []
    failures: list[BaseException] = []

    def engine_failed(exc: BaseException) -> None:
        failures.append(exc)
        log.error("the engine failed (%s): exiting in %.0f s", exc, ENGINE_FAILURE_EXIT_DELAY)
        threading.Timer(ENGINE_FAILURE_EXIT_DELAY, lambda: setattr(server, "should_exit", True)).start()

    asgi = build_app(state, _loader(config, clients, engine_failed), config.cors_origins,
                     config.max_request_body_bytes)
    uv_config = uvicorn.Config(asgi, host=config.host, port=config.port, log_config=None,
                               timeout_graceful_shutdown=1, access_log=False)
    server = DrainingServer(uv_config, state, config.shutdown_timeout)
    state.on_load_failure = lambda: setattr(server, "should_exit", True)
    log.info("listening on http://%s:%d", config.host, config.port)
    try:
        server.run()
    finally:
        for client in clients:  # after a drain that timed out, the engine is still busy: end it at once
            client.stop(timeout=0 if server.cut_off else ENGINE_STOP_TIMEOUT)
    return 1 if state.load_error is not None or failures else 0
