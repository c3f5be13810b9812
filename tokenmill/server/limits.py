"""Bounds on one request's size, each a clear 400 naming the parameter. The bounds are defined once, as EngineConfig's
``max_*`` server fields, and read from there. They keep one request from costing the server out of proportion: a
long stop string sets the detokenizer's hold-back and is searched every step; logit_bias and stop_token_ids are
applied per step; n and prompt lists multiply everything. The body itself is bounded at the edge (server/edge.py)."""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import EngineRequest
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import CompletionRequest, SamplingFields


def _at_most(value: int, limit: int, param: str, what: str) -> None:
    if value > limit:
        raise bad_request(f"{what}: {value} given, at most {limit} allowed on this server", param=param,
                          code="limit_exceeded")


def check_limits(body: SamplingFields, limits: EngineConfig) -> None:
    _at_most(body.n, limits.max_n, "n", "n (choices per prompt)")
    stop = body.stop or []
    _at_most(len(stop), limits.max_stop_sequences, "stop", "number of stop sequences")
    _at_most(max((len(s) for s in stop), default=0), limits.max_stop_length, "stop",
             "characters in a stop sequence")
    _at_most(len(body.logit_bias or {}), limits.max_logit_bias, "logit_bias", "logit_bias entries")
    _at_most(len(body.stop_token_ids or []), limits.max_stop_token_ids, "stop_token_ids", "stop_token_ids entries")
    if isinstance(body, CompletionRequest) and isinstance(body.prompt, list) and body.prompt \
            and not isinstance(body.prompt[0], int):
        _at_most(len(body.prompt), limits.max_prompts, "prompt", "prompts in one request")
    _at_most(len(getattr(body, "tools", None) or []), limits.max_tools, "tools", "tools")


# What one entry of a request's output costs the API process, about (a candidate token's dict as built and as JSON;
# one float of an embedding as a Python float in a list and as JSON).
LOGPROB_ENTRY_BYTES = 256
EMBEDDING_FLOAT_BYTES = 24


def check_output_budget(requests: list[EngineRequest], hidden_size: int, limits: EngineConfig) -> None:
    """A 400 naming the field when what the requests will make the server build -- the prompt logprobs (prompts x
    choices x positions x candidates) or the embeddings (inputs x dimensions) -- is over the request budget."""
    budget = limits.request_output_budget_bytes
    for field, what, entries, size in (
            ("prompt_logprobs", "prompt logprobs", sum(len(r.prompt_token_ids) * (1 + r.params.prompt_logprobs)
                                                       for r in requests if r.params.prompt_logprobs is not None),
             LOGPROB_ENTRY_BYTES),
            ("input", "embeddings", hidden_size * sum(1 for r in requests if r.params.pooling is not None),
             EMBEDDING_FLOAT_BYTES)):
        if entries * size > budget:
            raise bad_request(f"{what}: this request asks for {entries} values (about {entries * size} bytes to "
                              f"build), more than the {budget} bytes this server builds for one request "
                              f"(request_output_budget_bytes); send fewer prompts, choices or candidates",
                              param=field, code="limit_exceeded")
