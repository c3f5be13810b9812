"""What chat and completions share: request -> engine requests, admission, the n-choice stream, metrics, logs."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineClient, EngineDeadError
from tokenmill.engine.messages import BATCH, ContextLengthError, EngineRequest, PromptError, RequestOutput
from tokenmill.sampling.params import SamplingParamError, SamplingParams
from tokenmill.server.admission import Admission, Reservation
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.ledger import Usage, UsageLedger
from tokenmill.server.metrics import Metrics
from tokenmill.server.protocol import SamplingFields
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.tenants import NO_CHARGE, Charge, Tenants
from tokenmill.server.tool_calls import ToolPlan
from tokenmill.tools.formats import HERMES, ToolFormat
from tokenmill.tools.reasoning import ReasoningFormat

log = logging.getLogger("tokenmill.requests")


@dataclass
class ServerContext:
    """Everything a handler needs; built once when the engine is ready."""

    client: EngineClient
    metrics: Metrics
    model_name: str
    config: EngineConfig  # the request limits (max_*) among its fields
    admission: Admission
    tool_format: ToolFormat = HERMES
    reasoning: ReasoningFormat | None = None  # how thinking is split from the answer (tools/reasoning.py)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0, 0))  # /v1/responses' store
    tenants: Tenants = field(default_factory=lambda: Tenants([]))  # the keys' models and rates (server/tenants.py)
    ledger: UsageLedger | None = None  # usage per key x model x hour, kept across restarts (server/ledger.py)

    def account(self, key_name: str | None, usage: Usage) -> None:
        """One request's usage, into the ledger and the per-key series."""
        if self.ledger is not None:
            self.ledger.record(key_name, self.model_name, usage)
        self.metrics.account(self.model_name, key_name, usage)


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """OpenAI/vLLM fields -> SamplingParams (``n`` choices per prompt); a bad value becomes a 400 naming the
    parameter."""
    fields = dict(n=body.n, max_tokens=max_tokens, stop=body.stop, seed=body.seed, logprobs=logprobs,
                  min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids or [],
                  include_stop_str_in_output=body.include_stop_str_in_output,
                  skip_special_tokens=body.skip_special_tokens,
                  logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None)
    optional = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty)
    fields.update({k: v for k, v in optional.items() if v is not None})
    try:
        return SamplingParams(**fields)
    except SamplingParamError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def make_requests(ctx: ServerContext, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
                  arrival: float, key_name: str | None, cache_salt: str | None = None,
                  service_tier: str | None = None) -> tuple[list[EngineRequest], Reservation, Charge]:
    """``params.n`` engine requests per prompt, validated (400s naming the parameter), of the priority the key and
    ``service_tier`` give, their promise charged to the caller's key (429 over its rates) and reserved (429 when it
    does not fit; batch work first). The caller's Tracker owns the reservation and the charge from here on."""
    priority = ctx.tenants.priority(key_name, service_tier)
    try:
        requests = ctx.client.make_requests(prompts, params, arrival, cache_salt, priority)
    except SamplingParamError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    except PromptError as exc:
        if isinstance(exc.cause, ContextLengthError):
            ctx.metrics.reject(ctx.model_name, "context_length")
            raise bad_request(str(exc), param=prompt_param, code="context_length_exceeded") from None
        raise bad_request(str(exc), param=prompt_param) from None
    try:
        charge = ctx.tenants.charge(key_name, sum(len(r.prompt_token_ids) + r.max_tokens for r in requests))
    except APIError:
        ctx.metrics.reject(ctx.model_name, "key_rate_limit")
        raise
    promise = sum(ctx.admission.kv_tokens(len(r.prompt_token_ids) + r.max_tokens) for r in requests)
    reservation = ctx.admission.reserve(promise, batch=priority == BATCH)
    if reservation is None:  # the server's capacity, not the key's: the key gets its request and tokens back
        charge.refund()
        ctx.metrics.reject(ctx.model_name, "admission")
        raise APIError(429, "The server is at capacity (promised KV tokens); retry later.", "rate_limit_error",
                       code="rate_limit_exceeded", headers={"Retry-After": str(ctx.admission.retry_after(promise))},
                       fallback=True)
    return requests, reservation, charge


@dataclass
class _Progress:
    request: EngineRequest
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    engine_seconds: float = 0.0
    finish_reason: str | None = None


@dataclass
class Tracker:
    """Per HTTP request: owns its admission reservation (released once, by ``close``, when the response is over),
    observes every output for metrics, and writes the request's log line at the end."""

    ctx: ServerContext
    endpoint: str
    arrival: float
    key_name: str | None
    requests: list[EngineRequest]
    reservation: Reservation
    charge: Charge = field(default_factory=lambda: NO_CHARGE)  # the key's token draw, settled at close
    tools: ToolPlan = field(default_factory=ToolPlan)  # chat: how its output is read for tool calls
    grammar_param: str | None = None  # the field its output constraint came from, for errors about it
    _progress: dict[str, _Progress] = field(default_factory=dict)
    finish_reasons: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._progress = {r.request_id: _Progress(r) for r in self.requests}

    def close(self) -> None:
        """The response is over (sent, failed, or its client left): give the promise back, settle the key's charge
        to the tokens used (each prompt once per choice, as it was charged, plus every output token), and account
        the request's usage (once: a second call changes nothing)."""
        if self.reservation.released:
            return
        self.reservation.release()
        self.charge.settle(sum(len(r.prompt_token_ids) for r in self.requests) + self.num_output_tokens)
        usage = self.usage(self.requests[0].params.n if self.requests else 1)
        ok = all(p.finish_reason not in (None, "error", "abort") for p in self._progress.values())
        self.ctx.account(self.key_name, Usage(1, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                                              usage["completion_tokens"], int(not ok),
                                              sum(p.engine_seconds for p in self._progress.values())))

    def observe(self, out: RequestOutput) -> None:
        """Metrics of one output; an output the engine refused mid-way (finish_reason "error": its grammar over the
        server's budget) becomes a 400 naming the constraint."""
        if out.error is not None:
            param = self.grammar_param
            raise bad_request(f"{param}: {out.error}" if param else out.error, param=param,
                              code="grammar_too_costly")
        now = time.monotonic()
        m, model = self.ctx.metrics, self.ctx.model_name
        p = self._progress[out.request_id]
        p.num_output_tokens = out.num_output_tokens
        p.num_cached_tokens = out.num_cached_tokens
        p.engine_seconds = max(p.engine_seconds, out.engine_seconds)
        if out.finished:
            p.finish_reason = out.finish_reason
        if out.new_token_ids:
            if p.first_token_time is None:
                p.first_token_time = now
                m.ttft.labels(model).observe(now - self.arrival)
                if self.key_name:
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
            "id": self.requests[0].request_id if self.requests else None, "endpoint": self.endpoint,
            "status": status, "key": self.key_name, "choices": len(self.requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in self.requests),
            "output_tokens": self.num_output_tokens,
            "ttft_s": round(min(first) - self.arrival, 4) if first else None,
            "e2e_s": round(time.monotonic() - self.arrival, 4),
            "finish_reason": ",".join(str(f) for f in self.finish_reasons) or "abort",
        }
        log.info("request", extra={"fields": record})


async def merged_outputs(client: EngineClient, requests: list[EngineRequest]
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come, tagged with the request's index. Closing this
    iterator cancels every pump, which aborts the requests still running. An engine that dies mid-request becomes
    an OpenAI-shaped 500 (a body, or an error event in a stream that has started)."""
    try:
        async for item in _merged(client, requests):
            yield item
    except EngineDeadError as exc:
        raise APIError(500, f"The engine failed while generating: {exc}", "server_error", code="engine_failed") \
            from None


async def _merged(client: EngineClient, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(requests) == 1:
        async for out in client.generate(requests[0]):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, request: EngineRequest) -> None:
        try:
            async for out in client.generate(request):
                queue.put_nowait((index, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
