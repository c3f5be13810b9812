"""Per HTTP request of a generation endpoint: its engine requests' outputs, and what it holds while the engine works.

A Tracker owns what its request holds of shared capacity -- its admission reservation (server/admission.py) and its
draw on the key's token bucket (server/tenants.py) -- and gives both back once, when the engine has finished or
aborted every one of its engine requests, not when the client has read the answer: a slow reader holds only the text
still to be sent. The usage record (the ledger and the per-key series) is written at the same moment.

Outputs: one pump task per engine request takes its outputs from the engine client as they come (so the engine's end
is seen at once) into one queue that the response reads at its own pace (``outputs``); the metrics of sent tokens
(TTFT, inter-token latency, TPOT) are observed as the response takes them. A stream bounds the bytes waiting in that
queue (``buffer_limit``): a reader that falls that far behind has its engine requests aborted and its stream ends with
an error. ``close`` (the response is over, however it ended) stops the pumps, which aborts what still runs.

Invariant: the reservation is released and the charge settled exactly once (``_release``), by the first of: the engine
finishing the last engine request, the outputs failing (their engine requests aborted), or ``close``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from tokenmill.engine.client import EngineDeadError
from tokenmill.engine.messages import EngineRequest, RequestOutput
from tokenmill.server.admission import Reservation
from tokenmill.server.errors import APIError, bad_request, request_id
from tokenmill.server.ledger import Usage
from tokenmill.server.serving import ServerContext
from tokenmill.server.tenants import NO_CHARGE, Charge
from tokenmill.server.tool_calls import ToolPlan

log = logging.getLogger("tokenmill.requests")

_ENTRY_BYTES = 16  # what one token id or one logprob candidate counts for in a stream's buffer


def output_bytes(out: RequestOutput) -> int:
    """About what an output holds in memory until it is sent: its text and its numbers."""
    candidates = sum(1 + len(top) for _, top in out.new_logprobs)
    prompt = sum(1 + len(e[1]) for e in out.prompt_logprobs if e is not None) if out.prompt_logprobs else 0
    return (len(out.delta_text) + len(out.embedding or ())
            + _ENTRY_BYTES * (len(out.new_token_ids) + candidates + prompt))


@dataclass
class _Progress:
    request: EngineRequest
    # Sent (as the response takes the outputs): for the latency metrics.
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Engine-side (as the pumps see the outputs): for usage and the charge.
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    engine_seconds: float = 0.0
    finish_reason: str | None = None


@dataclass
class Tracker:
    """One HTTP request's engine requests (``n`` per prompt), what they hold, their outputs and their metrics."""

    ctx: ServerContext
    endpoint: str
    arrival: float
    key_name: str | None
    requests: list[EngineRequest]
    reservation: Reservation
    charge: Charge = field(default_factory=lambda: NO_CHARGE)  # the key's token draw, settled at release
    tools: ToolPlan = field(default_factory=ToolPlan)  # chat: how its output is read for tool calls
    grammar_param: str | None = None  # the field its output constraint came from, for errors about it
    buffer_limit: int | None = None  # bytes of outputs waiting to be sent (a stream's); None: unbounded
    finish_reasons: list[str | None] = field(default_factory=list)
    _progress: dict[str, _Progress] = field(default_factory=dict)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (index, output) | None (a pump ended)
    _pumps: list[asyncio.Task] = field(default_factory=list)
    _pending_bytes: int = 0
    _failure: APIError | None = None  # why the outputs stopped early (the engine died, the buffer overflowed)
    _released: bool = False

    def __post_init__(self) -> None:
        self._progress = {r.request_id: _Progress(r) for r in self.requests}

    # --- the engine's side
    def start(self) -> None:
        """Submit the engine requests (once): the engine works from here on, however slowly the response is read."""
        if not self._pumps:
            self._pumps = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(self.requests)]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Each engine request's outputs as they come, tagged with the request's index, observed for the metrics as
        they are taken. Raises the APIError that stopped them early (the engine failed, a stream fell too far
        behind, the engine refused one mid-way)."""
        self.start()
        done = 0
        while done < len(self._pumps):
            if self._failure is not None:
                raise self._failure
            item = await self._queue.get()
            if item is None:
                done += 1
                continue
            index, out = item
            self._pending_bytes -= output_bytes(out)
            self.observe(out)
            yield index, out
        if self._failure is not None:
            raise self._failure

    async def _pump(self, index: int, request: EngineRequest) -> None:
        try:
            async for out in self.ctx.client.generate(request):
                self._engine_output(out)
                self._queue.put_nowait((index, out))
                self._pending_bytes += output_bytes(out)
                if self.buffer_limit is not None and self._pending_bytes > self.buffer_limit \
                        and self._queue.qsize() > 1:
                    self._fail(APIError(
                        503, f"The client read the stream too slowly: more than {self.buffer_limit} bytes of output "
                             "waited to be sent (stream_buffer_bytes); the request was cut off.",
                        "server_error", code="stream_buffer_exceeded"))
                    return
        except EngineDeadError:
            self._fail(APIError(500, f"The engine failed while generating (request id {request_id()}); "
                                     "the server is restarting it.", "server_error", code="engine_failed"))
        finally:
            self._queue.put_nowait(None)

    def _fail(self, error: APIError) -> None:
        """Stop every pump (which aborts their engine requests), release what the request holds, and end the outputs
        with ``error``."""
        if self._failure is None:
            self._failure = error
            log.warning("request %s cut off: %s", request_id(), error.code)
        for task in self._pumps:
            if task is not asyncio.current_task():
                task.cancel()
        self._release()
        self._queue.put_nowait(None)  # wakes a reader waiting on the queue

    def _engine_output(self, out: RequestOutput) -> None:
        p = self._progress[out.request_id]
        p.num_output_tokens = out.num_output_tokens
        p.num_cached_tokens = out.num_cached_tokens
        p.engine_seconds = max(p.engine_seconds, out.engine_seconds)
        if out.finished:
            p.finish_reason = out.finish_reason
            if all(q.finish_reason is not None for q in self._progress.values()):
                self._release()

    def _release(self) -> None:
        """Give the promise back, settle the key's charge to the tokens used (each prompt once per choice, as it was
        charged, plus every output token) and account the request's usage. Once."""
        if self._released:
            return
        self._released = True
        self.reservation.release()
        self.charge.settle(sum(len(r.prompt_token_ids) for r in self.requests) + self.num_output_tokens)
        usage = self.usage(self.requests[0].params.n if self.requests else 1)
        ok = all(p.finish_reason not in (None, "error", "abort") for p in self._progress.values())
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.ctx.account(self.key_name, Usage(1, usage["prompt_tokens"], cached, usage["completion_tokens"],
                                              int(not ok), sum(p.engine_seconds for p in self._progress.values())))

    def close(self) -> None:
        """The response is over (sent, failed, or its client left): stop the pumps (aborting the engine requests still
        running) and release what is still held. A second call changes nothing."""
        for task in self._pumps:
            task.cancel()
        self._release()

    # --- the client's side: metrics of what is sent
    def observe(self, out: RequestOutput) -> None:
        """Metrics of one output as it is sent; an output the engine refused mid-way (finish_reason "error") becomes an
        error: a 400 naming the constraint when its grammar went over the server's budget, else a 500."""
        if out.error is not None:
            if out.error_code == "grammar_too_costly":
                param = self.grammar_param
                raise bad_request(f"{param}: {out.error}" if param else out.error, param=param,
                                  code="grammar_too_costly")
            log.error("request %s: engine request %s ended with an error", request_id(), out.request_id)
            raise APIError(500, f"The engine could not run this request (request id {request_id()}).", "server_error",
                           code=out.error_code)
        now = time.monotonic()
        m, model = self.ctx.metrics, self.ctx.model_name
        p = self._progress[out.request_id]
        if out.new_token_ids:
            if p.first_token_time is None:
                p.first_token_time = now
                m.ttft.labels(model).observe(now - self.arrival)
                if self.key_name and m.per_key:
                    m.key_ttft.labels(model, self.key_name).observe(now - self.arrival)
            else:
                m.itl.labels(model).observe(now - p.last_token_time)
            p.last_token_time = now
        if out.finished:
            self._finish(p, out, now)

    def _finish(self, p: _Progress, out: RequestOutput, now: float) -> None:
        m, model = self.ctx.metrics, self.ctx.model_name
        m.e2e.labels(model).observe(now - self.arrival)
        if out.first_scheduled_time is not None:
            m.queue.labels(model).observe(out.first_scheduled_time - self.arrival)
            if p.first_token_time is not None:
                m.prefill.labels(model).observe(p.first_token_time - out.first_scheduled_time)
        if p.first_token_time is not None:
            m.decode.labels(model).observe(now - p.first_token_time)
            if out.num_output_tokens > 1:  # TPOT = (last token - first token) / (output tokens - 1)
                m.tpot.labels(model).observe((p.last_token_time - p.first_token_time) / (out.num_output_tokens - 1))
        m.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
        m.generation_tokens.labels(model).inc(out.num_output_tokens)
        m.success.labels(model, out.finish_reason or "unknown").inc()
        self.finish_reasons.append(out.finish_reason)

    @property
    def num_output_tokens(self) -> int:
        return sum(p.num_output_tokens for p in self._progress.values())

    def usage(self, n: int) -> dict:
        """OpenAI's usage object. ``requests`` are n choices per prompt; each prompt counts once, as its first
        choice saw it (cached_tokens: its prompt tokens served from the prefix cache)."""
        firsts = self.requests[::n]
        prompt = sum(len(r.prompt_token_ids) for r in firsts)
        cached = sum(self._progress[r.request_id].num_cached_tokens for r in firsts)
        completion = self.num_output_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def log_line(self, status: int) -> None:
        """One line per HTTP request: never the prompt, never the key itself."""
        first = [p.first_token_time for p in self._progress.values() if p.first_token_time is not None]
        record = {
            "id": request_id(), "endpoint": self.endpoint, "status": status, "key": self.key_name,
            "choices": len(self.requests), "prompt_tokens": sum(len(r.prompt_token_ids) for r in self.requests),
            "output_tokens": self.num_output_tokens,
            "ttft_s": round(min(first) - self.arrival, 4) if first else None,
            "e2e_s": round(time.monotonic() - self.arrival, 4),
            "finish_reason": ",".join(str(f) for f in self.finish_reasons) or "abort",
        }
        log.info("request", extra={"fields": record})
