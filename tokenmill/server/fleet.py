"""The models a server serves: one ``ModelHost`` each (its engine process, its state, its restarts), and the
``Fleet`` that finds the host a request names and keeps on-demand models within ``max_loaded_models``.

States of a host: ``unloaded`` (an on-demand model not loaded) -> ``loading`` -> ``ready``; a ready engine that dies
goes ``restarting`` (in a server of several models: reloaded after a backoff that doubles from 1 s to 60 s while it
keeps failing within a minute of its start) or ``failed`` (a lone model: the server exits, its supervisor restarts
it, as before). A model that fails its first load is ``failed`` and stops the server (a configuration error, said
at once), except an on-demand one, whose next request tries again.

Invariants: only a host's own methods set its ``ctx`` and ``status``, under its lock; an engine's failure callback
acts only for the load that started that engine (``_generation``), so a deliberate unload never looks like a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import AsyncIterator, Callable

from tokenmill.config import EngineConfig, RouteSpec
from tokenmill.logs import one_line
from tokenmill.server.errors import APIError
from tokenmill.server.metrics import Metrics
from tokenmill.server.serving import ServerContext

log = logging.getLogger(__name__)

# Builds a model's context: starts its engine (blocking, on a loader thread) with the callback its failure calls.
LoadContext = Callable[[EngineConfig, Callable[[BaseException], None]], ServerContext]
MAX_BACKOFF_S = 60.0
STABLE_AFTER_S = 60.0  # an engine that served this long before it failed restarts after the shortest backoff


def backoff(failures: int) -> float:
    return min(MAX_BACKOFF_S, 2.0 ** (failures - 1))


def unavailable(message: str, retry_after: float | None = None) -> APIError:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return APIError(503, message, "service_unavailable_error", headers=headers, fallback=True)


class ModelHost:
    def __init__(self, name: str | None, aliases: tuple[str, ...], config: EngineConfig, load: LoadContext,
                 metrics: Metrics, *, on_demand: bool = False, restart: bool = False,
                 on_fatal: Callable[["ModelHost", BaseException], None] = lambda host, exc: None):
        self.name = name  # None for a lone model until its engine names it
        self.aliases, self.config, self._load, self.metrics = aliases, config, load, metrics
        self.on_demand, self.restart, self.on_fatal = on_demand, restart, on_fatal
        self.ctx: ServerContext | None = None
        self.status = "unloaded" if on_demand else "loading"
        self.error: BaseException | None = None
        self.failures = 0  # engine failures in a row, each within STABLE_AFTER_S of its start
        self.retry_at = 0.0  # when a restart's load begins (monotonic)
        self.last_used = time.monotonic()
        self.served = False  # it has been ready once
        self._started_at = 0.0
        self._generation = 0
        self._loading = False  # a load thread is waiting or running
        self.in_use = 0  # requests between finding this model and holding its admission (Fleet.hold)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        if name is not None:
            metrics.add_model(name, self._engine)

    def _engine(self):
        ctx = self.ctx
        return None if ctx is None else (ctx.client, ctx.admission)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(i for i in (self.name, *self.aliases) if i is not None)

    @property
    def idle(self) -> bool:
        """No request holds or is about to hold this model (so it may be unloaded)."""
        ctx = self.ctx
        return self.in_use == 0 and (ctx is None or (ctx.admission.num_reserved == 0 and
                                                     ctx.client.stats.num_running == 0 and
                                                     ctx.client.stats.num_waiting == 0))

    # --- lifecycle
    def load(self, delay: float = 0.0) -> None:
        """Start loading on a thread (after ``delay`` seconds), unless it is loaded or loading already."""
        with self._lock:
            if self._stopped.is_set() or self._loading or self.status == "ready":
                return
            self._loading = True
            self.status = "restarting" if delay else "loading"
            self.retry_at = time.monotonic() + delay
            self._generation += 1
            generation = self._generation
        threading.Thread(target=self._run_load, args=(generation, delay), daemon=True,
                         name=f"tokenmill-load-{self.name or 'model'}").start()

    def _run_load(self, generation: int, delay: float) -> None:
        if delay and self._stopped.wait(delay):
            return
        with self._lock:
            if generation != self._generation:  # unloaded or stopped while it waited
                self._loading = False
                return
            self.status = "loading"
        try:
            ctx = self._load(self.config, lambda exc: self._engine_failed(exc, generation))
        except BaseException as exc:  # noqa: BLE001 - the model's status and the log say why
            log.error("model %sfailed to load: %s", f"{self.name} " if self.name else "", one_line(str(exc)))
            with self._lock:
                self.error, restarting = exc, delay > 0
                self.status, self._loading = "failed", False
            if restarting:  # a restart that failed to load: try again, later
                self.failures += 1
                self.load(backoff(self.failures))
            elif not self.on_demand:
                self.on_fatal(self, exc)
            return
        with self._lock:
            self._loading = False
            if self._stopped.is_set() or generation != self._generation:
                ctx.client.stop(timeout=0)
                return
            if self.name is None:
                self.name = ctx.model_name
                self.metrics.add_model(self.name, self._engine)
            self.ctx, self.status, self.error, self.served = ctx, "ready", None, True
            self._started_at = self.last_used = time.monotonic()
        log.info("model %s is ready", self.name)
        if not ctx.client.healthy:  # it died between starting and now: its failure callback found it still loading
            self._engine_failed(ctx.client.error or RuntimeError("the engine died as it started"), generation)

    def _engine_failed(self, exc: BaseException, generation: int) -> None:
        with self._lock:
            if generation != self._generation or self.status != "ready":
                return  # an engine this host already let go of
            self.error, ctx, self.ctx = exc, self.ctx, None
            self.status = "failed"
        if not self.restart:
            self.on_fatal(self, exc)
            return
        stable = time.monotonic() - self._started_at >= STABLE_AFTER_S
        self.failures = 1 if stable else self.failures + 1
        delay = backoff(self.failures)
        self.metrics.engine_restarts.labels(self.name).inc()
        log.error("model %s: its engine failed (%s); restarting in %.0f s", self.name, exc, delay)
        threading.Thread(target=ctx.client.stop, kwargs={"timeout": 0}, daemon=True).start()
        self.load(delay)

    def unload(self, only_if_idle: bool = False, timeout: float = 10.0, wait: bool = False) -> bool:
        """Let the engine go (in the background unless ``wait``); with ``only_if_idle``, only a ready, idle model
        (checked under the lock, so a model that just failed or got a request is left alone). True if it did."""
        with self._lock:
            if only_if_idle and not (self.status == "ready" and self.idle):
                return False
            ctx, self.ctx = self.ctx, None
            self._generation += 1
            self.status = "unloaded" if self.on_demand else "failed"
        if ctx is not None:
            log.info("model %s unloaded", self.name)
            if wait:
                ctx.client.stop(timeout=timeout)
            else:
                threading.Thread(target=ctx.client.stop, kwargs={"timeout": timeout}, daemon=True).start()
        return True

    def stop(self, timeout: float) -> None:
        self._stopped.set()
        self.unload(timeout=timeout, wait=True)

    # --- requests
    def context(self) -> ServerContext:
        """The serving context, or a 503 that says why there is none (with Retry-After where it will pass); what
        failed is in the operator's log, not in the answer (an exception's text names paths and devices)."""
        ctx, status = self.ctx, self.status
        if ctx is not None and ctx.client.healthy:
            self.last_used = time.monotonic()
            return ctx
        if status == "restarting":
            raise unavailable(f"The model `{self.name}` is restarting after its engine failed.",
                              self.retry_at - time.monotonic() + 1)
        if status == "failed" and not self.restart and not self.on_demand:
            raise unavailable("The engine has failed; the server needs a restart.")
        if status == "failed":
            raise unavailable(f"The model `{self.name}` failed to load.")
        if status == "unloaded":
            raise unavailable(f"The model `{self.name}` is not loaded.", 5)
        if status == "ready":  # its engine died a moment ago; its failure callback is on its way
            raise unavailable(f"The model `{self.name}` has failed.", 5)
        raise unavailable("The model is still loading." if self.name is None else
                          f"The model `{self.name}` is still loading.", 5)


class Fleet:
    def __init__(self, hosts: list[ModelHost], routes: list[RouteSpec] | None = None, max_loaded: int = 1,
                 idle_unload_s: float = 600.0, load_wait_s: float = 60.0):
        self.hosts, self.max_loaded = hosts, max_loaded
        self.routes = {route.name: route for route in routes or []}
        self.idle_unload_s, self.load_wait_s = idle_unload_s, load_wait_s
        self._stopped = threading.Event()

    @property
    def default(self) -> ModelHost:
        return self.hosts[0]

    @property
    def lone(self) -> bool:
        """One model and no routes: before it loads, any ``model`` finds it (the 503 says it is loading), as a
        server of one model always answered."""
        return len(self.hosts) == 1 and not self.routes

    def start(self) -> None:
        for host in self.hosts:
            if not host.on_demand:
                host.load()
        if any(host.on_demand for host in self.hosts):
            threading.Thread(target=self._unload_idle, daemon=True, name="tokenmill-idle-unload").start()

    def stop(self, timeout: float) -> None:
        self._stopped.set()
        for host in self.hosts:
            host.stop(timeout)

    def find(self, model_id: str | None) -> ModelHost | None:
        if model_id is None or (self.lone and self.default.name is None):
            return self.default
        return next((host for host in self.hosts if model_id in host.ids), None)

    @contextlib.asynccontextmanager
    async def hold(self, host: ModelHost) -> AsyncIterator[ServerContext]:
        """``host``'s context, the model counted busy (never unloaded) until the block ends: by then a request
        holds its admission reservation, which keeps it busy until the response is over."""
        host.in_use += 1
        try:
            yield await self.context(host)
        finally:
            host.in_use -= 1

    async def context(self, host: ModelHost) -> ServerContext:
        """``host``'s context; an on-demand model is loaded first (the request waits up to load_wait_s)."""
        if host.on_demand and host.status in ("unloaded", "failed"):
            self._make_room(host)
            host.load()
        deadline = time.monotonic() + (self.load_wait_s if host.on_demand else 0.0)
        while True:
            try:
                return host.context()
            except APIError:
                if host.status != "loading" or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.05)

    def _make_room(self, host: ModelHost) -> None:
        """Unload the least recently used idle on-demand model while ``max_loaded`` are loaded or on their way
        (503 if all are busy). Runs on the event loop; the engine stops in the background."""
        loaded = [h for h in self.hosts if h.on_demand and h is not host and
                  h.status in ("loading", "ready", "restarting")]
        if len(loaded) < self.max_loaded:
            return
        for victim in sorted(loaded, key=lambda h: h.last_used):
            if victim.unload(only_if_idle=True):
                return
        raise unavailable(f"The model `{host.name}` is not loaded and every on-demand slot is busy "
                          f"(max_loaded_models = {self.max_loaded}).", 10)

    def _unload_idle(self) -> None:
        while not self._stopped.wait(1.0):
            now = time.monotonic()
            for host in self.hosts:
                if host.on_demand and now - host.last_used > self.idle_unload_s:
                    host.unload(only_if_idle=True)

    def ready(self, model_id: str | None = None) -> tuple[bool, str]:
        """(ready, status) of one model, or overall: every model loaded at start-up is ready."""
        if model_id is not None:
            host = self.find(model_id)
            return (False, "unknown model") if host is None else (host.status == "ready", host.status)
        pending = [h for h in self.hosts if not h.on_demand and h.status != "ready"]
        return (not pending, "ready" if not pending else pending[0].status)

    def statuses(self) -> dict[str, str]:
        return {host.name or "model": host.status for host in self.hosts}
