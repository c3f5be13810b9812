"""EngineClient: the asyncio face of the engine. The engine steps in its own thread, never on the event loop.

Commands (add, abort) go to the engine thread through a lock-protected inbox and are applied between steps,
so an abort takes effect within one engine step. Outputs come back to each request's asyncio queue through
``loop.call_soon_threadsafe``.

Admission: the client keeps the token *promise* (prompt + max_tokens) of every request it admitted and has
not released; ``reserve`` refuses requests whose promise would push the total past ``admission_limit``
tokens, so overload becomes a fast, explicit rejection instead of an unbounded queue. A reservation is made
when the request is admitted (before its stream starts) and released when it ends, or by ``release``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import AsyncIterator

from tokenmill.scheduler.engine import LLMEngine
from tokenmill.scheduler.outputs import RequestOutput
from tokenmill.scheduler.request import Request

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can be served."""


@dataclass
class ClientStats:
    """Counters the server turns into metrics."""

    num_aborted: int = 0
    promised_tokens: int = 0


class _Live:
    """A request in flight: its output queue, on the loop that reads it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.loop = loop


class EngineClient:
    def __init__(self, engine: LLMEngine, admission_limit: int):
        self.engine = engine
        self.admission_limit = admission_limit
        self.stats = ClientStats()
        self._live: dict[str, _Live] = {}
        self._promises: dict[str, int] = {}  # request id -> reserved tokens (event-loop thread only)
        self._cv = threading.Condition()
        self._inbox_add: list[Request] = []
        self._inbox_abort: list[str] = []
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)

    # --- lifecycle
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def saturation(self) -> float:
        """Promised tokens over the admission limit: 1.0 means new requests are being refused."""
        return self.stats.promised_tokens / self.admission_limit

    # --- requests
    def reserve(self, requests: list[Request]) -> bool:
        """Admit ``requests`` together if their promise fits, reserving it. An idle server admits anything that
        passed validation, so no single valid request is refused forever."""
        promise = sum(r.num_prompt_tokens + r.max_tokens for r in requests)
        if self._promises and self.stats.promised_tokens + promise > self.admission_limit:
            return False
        for r in requests:
            self._promises[r.request_id] = r.num_prompt_tokens + r.max_tokens
        self.stats.promised_tokens += promise
        return True

    def release(self, request_ids: list[str]) -> None:
        """Give back reservations (idempotent: a request's own end already released it)."""
        for rid in request_ids:
            self.stats.promised_tokens -= self._promises.pop(rid, 0)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue ``request`` and yield its outputs until it finishes. Closing the iterator early (the client
        went away, the handler was cancelled) aborts the request and frees its KV blocks. Its reservation,
        if any, is released at the end."""
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        live = _Live(asyncio.get_running_loop())
        rid = request.request_id
        self._live[rid] = live
        finished = False
        try:
            with self._cv:
                self._inbox_add.append(request)
                self._cv.notify()
            while True:
                item = await live.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._live.pop(rid, None)
            self.release([rid])
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox_abort.append(request_id)
            self._cv.notify()

    # --- engine thread
    def _deliver(self, output: RequestOutput | BaseException, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.loop.call_soon_threadsafe(live.queue.put_nowait, output)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._inbox_add or self._inbox_abort or self._stopping
                               or self.engine.has_unfinished()):
                        self._cv.wait()
                    if self._stopping:
                        return
                    adds, self._inbox_add = self._inbox_add, []
                    aborts, self._inbox_abort = self._inbox_abort, []
                for request in adds:
                    self.engine.add(request)
                for rid in aborts:
                    if self.engine.abort(rid) is not None:
                        self.stats.num_aborted += 1
                if self.engine.has_unfinished():
                    for output in self.engine.step():
                        self._deliver(output, output.request_id)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiting request
            log.exception("engine thread failed")
            self.error = exc
            for rid in list(self._live):
                self._deliver(exc, rid)
