"""EngineClient: the API process's one handle on the engine. The server sees this class and the message types only.

It owns what the API side needs without the model: the tokenizer (its calls run on a worker thread, never on the
event loop), request validation against the loaded engine's ``EngineInfo``, admission control, and a queue per live
request fed by the engine's outputs. The engine core itself runs in a child process (engine/process.py) or, with
``in_process``, on a thread beside the server.

Admission control (engine/admission.py) refuses requests whose token promise does not fit, with a Retry-After
estimated from how fast admitted work drains.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from tokenmill.config import EngineConfig
from tokenmill.engine.admission import Admission
from tokenmill.engine.messages import (EngineInfo, EngineRequest, EngineStats, RequestOutput, StepOutputs,
                                       validate_request)
from tokenmill.engine.process import EngineDeadError, EngineProcess, InProcessEngine
from tokenmill.models.tokenizer import Tokenizer
from tokenmill.sampling.params import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["EngineClient", "EngineDeadError"]


class EngineClient:
    def __init__(self, config: EngineConfig, in_process: bool = False):
        self.config = config
        self.tokenizer: Tokenizer | None = None  # loaded by start(), while the engine loads its model
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer")
        self._engine = InProcessEngine(config) if in_process else EngineProcess(config)
        self.engine_in_own_process = not in_process
        self.info: EngineInfo | None = None
        self.stats = EngineStats()  # the engine's counters after its latest step
        self.admission = Admission(0)  # sized when the engine is ready (event-loop thread only)
        self._live: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        # Called once the engine has failed and every request in flight has its error (``tokenmill serve`` exits).
        self.on_failure: Callable[[BaseException], None] = lambda exc: None

    # --- lifecycle
    def start(self) -> EngineInfo:
        """Start the engine and wait until its model is loaded (call off the event loop: it takes seconds)."""
        def load_tokenizer() -> Tokenizer:
            return Tokenizer.of_model(self.config.model, self.config.tokenizer_cache_dir)
        if self.engine_in_own_process:  # load it while the child loads the model
            tokenizer = self._tokenizer_thread.submit(load_tokenizer)
            self.info = self._engine.start(self._on_step, self._on_dead)
            self.tokenizer = tokenizer.result()
        else:  # one process: transformers' lazy imports are not safe to race from two threads
            self.info = self._engine.start(self._on_step, self._on_dead)
            self.tokenizer = load_tokenizer()
        self.admission = Admission(int(self.info.kv_capacity_tokens * self.config.admission_overcommit))
        return self.info

    def stop(self, timeout: float = 10.0) -> None:
        self._engine.stop(timeout)
        self._tokenizer_thread.shutdown(wait=False)

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def admission_limit(self) -> int:
        return self.admission.limit

    @property
    def promised_tokens(self) -> int:
        return self.admission.promised_tokens

    @property
    def saturation(self) -> float:
        """Promised tokens over the admission limit: 1.0 means new requests are being refused."""
        return self.promised_tokens / self.admission_limit if self.admission_limit else 0.0

    # --- tokenizer, off the event loop
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._off_loop(self.tokenizer.encode, text, add_special_tokens)

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                  tools: list[dict] | None = None) -> list[int]:
        return await self._off_loop(self.tokenizer.apply_chat_template, messages, add_generation_prompt, tools)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._off_loop(self.tokenizer.decode, token_ids, False)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    # --- requests
    def make_request(self, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                     request_id: str | None = None, cache_salt: str | None = None) -> EngineRequest:
        """Validate against the loaded model (ValueError naming the problem) into a plain-data request."""
        max_tokens = validate_request(self.info, prompt_token_ids, params)
        return EngineRequest(request_id or uuid.uuid4().hex, list(prompt_token_ids), params, max_tokens,
                             arrival_time, cache_salt)

    def reserve(self, requests: list[EngineRequest]) -> bool:
        """Admit ``requests`` together if their promise (prompt + max_tokens) fits, reserving it."""
        return self.admission.reserve({r.request_id: len(r.prompt_token_ids) + r.max_tokens for r in requests})

    def retry_after(self, requests: list[EngineRequest]) -> int:
        """Seconds a refused client should wait before ``requests`` would fit."""
        return self.admission.retry_after(sum(len(r.prompt_token_ids) + r.max_tokens for r in requests))

    def release(self, request_ids: list[str]) -> None:
        """Give back reservations (idempotent: a request's own end already released it)."""
        self.admission.release(request_ids)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` and yield its outputs until it finishes. Closing the iterator early (the client
        went away, the handler was cancelled) aborts the request and frees its KV blocks. Its reservation,
        if any, is released at the end."""
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        self._loop = asyncio.get_running_loop()
        rid = request.request_id
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._live[rid] = queue
        finished = False
        try:
            self._engine.submit(request)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._live.pop(rid, None)
            self.release([rid])
            if not finished and self.error is None:
                self._engine.abort(rid)

    # --- engine side (called on the engine's receiver thread)
    def _on_step(self, step: StepOutputs) -> None:
        self.stats = step.stats
        if step.outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, step.outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._live.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_dead(self, exc: BaseException) -> None:
        self.error = exc
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, exc)
        self.on_failure(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._live.values():
            queue.put_nowait(exc)
