"""What the generation endpoints share: the server context, request -> engine requests, the key's charge, admission.
The requests' outputs and what they hold are the Tracker's (server/tracker.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.engine.client import EngineClient
from tokenmill.engine.messages import BATCH, ContextLengthError, EngineRequest, PromptError
from tokenmill.sampling.params import SamplingParamError, SamplingParams
from tokenmill.server.admission import Admission, Reservation
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.ledger import Usage, UsageLedger
from tokenmill.server.limits import check_output_budget
from tokenmill.server.metrics import Metrics
from tokenmill.server.protocol import SamplingFields
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.tenants import Charge, Tenants
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
        requests = ctx.client.make_requests(prompts, params, arrival, cache_salt, priority,
                                            ctx.tenants.cache_scope(key_name))
    except SamplingParamError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    except PromptError as exc:
        if isinstance(exc.cause, ContextLengthError):
            ctx.metrics.reject(ctx.model_name, "context_length")
            raise bad_request(str(exc), param=prompt_param, code="context_length_exceeded") from None
        raise bad_request(str(exc), param=prompt_param) from None
    check_output_budget(requests, ctx.client.info.hidden_size, ctx.config)
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
