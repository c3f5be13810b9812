"""The plain-data messages between the API side and the engine core, both ways. No torch, nothing mutable shared:
every message is a copy, so the engine core can live in another process (it does under ``tokenmill serve``).

API -> engine: ``EngineRequest`` (submit), abort by request id.
Engine -> API: ``EngineInfo`` once when ready, then one ``StepOutputs`` per engine step: each request's new tokens,
text delta, finish and stop reason, logprobs and timing marks, plus the scheduler's counters.

Times are ``time.monotonic()`` seconds: one system-wide clock (CLOCK_MONOTONIC), comparable across processes.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tokenmill.kvcache.groups import KVGroups
from tokenmill.models.pooling import Pooling
from tokenmill.sampling.params import INT64_MIN, SamplingParamError, SamplingParams
from tokenmill.scheduler.output import PromptLogprob, TokenLogprobs
from tokenmill.scheduler.priority import BATCH, INTERACTIVE  # noqa: F401 - the API side names priorities from here


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Largest number of output tokens, after capping by the model length (validate_request).
    max_tokens: int
    arrival_time: float
    # Only requests with equal salts share prefix-cache blocks (vLLM's ``cache_salt``; None is a salt too).
    cache_salt: str | None = None
    # Lower first: INTERACTIVE or BATCH (scheduler/priority.py).
    priority: int = INTERACTIVE
    # Whose cached blocks it may share, besides the salt: the server sets it from the caller's API key (a tenant's
    # blocks are its own unless its keys share a cache group); None on a server without keys.
    cache_scope: str | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request: deltas, so a stream can send them as they come."""
    request_id: str
    new_token_ids: list[int]
    delta_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    # Prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # The matched stop string or stop token id; None for EOS, length, abort and error.
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The prompt's logprobs (one per prompt token, the first None), in the request's first output with tokens.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # An embedding request's pooled hidden state (sampling_params.pooling), in its first output with tokens.
    embedding: list[float] | None = None
    # Engine timing marks: when the request was first scheduled, when these tokens were sampled.
    first_scheduled_time: float | None = None
    token_time: float | None = None
    # finish_reason "error": why the engine refused the request while running it, for the client (never an exception's
    # text), and of what kind: "grammar_too_costly" (its grammar went over the server's budget), "engine_error".
    error: str | None = None
    error_code: str | None = None
    # Engine time spent on the request so far: each step's wall time shared among its requests by the tokens it
    # computed for each (the usage ledger's cost basis).
    engine_seconds: float = 0.0


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0 .. 1
    num_preemptions_total: int = 0
    num_aborted_total: int = 0
    resident_memory_bytes: int = 0  # of the process the engine core runs in
    # Pure decode steps (every scheduled request computes one token) and the wall time spent in them: their ratio
    # is the engine's own time per output token, to set against the TPOT that clients see.
    num_decode_steps_total: int = 0
    decode_step_seconds_total: float = 0.0
    # Prefix cache: prompt tokens looked up at admission, and of them the ones found cached.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Speculative decoding: draft tokens verified and accepted, in all and at each draft position (0 = the first).
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_drafted_by_position: list[int] = field(default_factory=list)
    spec_accepted_by_position: list[int] = field(default_factory=list)


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass
class EngineInfo:
    """What the API side needs to know of a loaded engine (sent once, when it is ready)."""
    model_name: str
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # tokens the pool holds in one KV group's tables
    kv_bytes_per_token: int  # every layer's K/V of one token (a request without windows)
    device: str
    dtype: str
    eos_token_ids: list[int] = field(default_factory=list)
    # Bytes of the model's weights as held (each parameter and quantized buffer once; oneDNN's packed copies aside).
    weight_bytes: int = 0
    kv_groups: KVGroups | None = None  # the cache's layer groups (kvcache/groups.py); None: one full group
    kv_block_size: int = 16
    hidden_size: int = 0  # of the final hidden states (an embedding's dimensions)
    pooling: Pooling = field(default_factory=lambda: Pooling("last", True, "default"))  # /v1/embeddings' pooling
    # How the model runs, as built: "compiled" | "eager" | "cuda_graphs" (a compile that failed runs eagerly).
    execution: str = "eager"

    def kv_tokens_held(self, num_tokens: int) -> int:
        """Of ``kv_capacity_tokens``, what a request of ``num_tokens`` tokens holds at most while it decodes: the
        tokens themselves with one group; with sliding windows, its blocks in every group (window groups hold only
        the window), fewer than ``num_tokens`` per group on average."""
        if self.kv_groups is None or self.kv_groups.num_groups == 1 and not self.kv_groups.windows[0]:
            return num_tokens
        return self.kv_groups.blocks_for(num_tokens, self.kv_block_size) * self.kv_block_size


class ContextLengthError(ValueError):
    """prompt + max_tokens do not fit the model length."""


def validate_request(info: EngineInfo, prompt_token_ids: list[int], params: SamplingParams) -> int:
    """Check a request against the loaded model; return its max_tokens (None in params = up to the model length).

    Raises ValueError (ContextLengthError, SamplingParamError) naming the problem; nothing is queued."""
    if not prompt_token_ids:
        raise ValueError("prompt: must contain at least one token")
    if not all(0 <= t < info.vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt: token ids must be in [0, {info.vocab_size})")
    params.validate_for_vocab(info.vocab_size)
    room = info.max_model_len - len(prompt_token_ids)
    wanted = params.max_tokens if params.max_tokens is not None else room
    if room < 1 or wanted > room:
        raise ContextLengthError(
            f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
            f"{len(prompt_token_ids) + wanted} tokens ({len(prompt_token_ids)} in the prompt, {wanted} for "
            f"the completion). Please reduce the prompt or the completion length.")
    if params.min_tokens > wanted:
        raise SamplingParamError("min_tokens", f"must not exceed the completion's length ({wanted} tokens here)")
    return wanted


def choice_seed(seed: int, choice: int) -> int:
    """Choice ``choice``'s seed of a request seeded with ``seed``: seed + choice, wrapped into int64 (two's
    complement), so that every seed the API accepts gives n distinct, reproducible seeds the engine's arrays hold."""
    return (seed + choice - INT64_MIN) % 2**64 + INT64_MIN


class PromptError(ValueError):
    """A prompt (or its context length) is invalid; ``index`` says which of a request's prompts."""

    def __init__(self, index: int, cause: ValueError):
        super().__init__(str(cause))
        self.index, self.cause = index, cause


def make_engine_requests(info: EngineInfo, prompts: Sequence[list[int]], params: SamplingParams, arrival_time: float,
                         cache_salt: str | None = None, new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
                         priority: int = INTERACTIVE, cache_scope: str | None = None) -> list[EngineRequest]:
    """The one front-end path (``LLM`` and the server): validate each prompt with ``params`` against the loaded model,
    then fan out ``params.n`` choices per prompt, prompt-major. Each choice is its own request with n = 1; seeded
    choices get distinct, reproducible seeds (seed + choice index). Raises SamplingParamError (a bad parameter) or
    PromptError (which prompt, and why: its ``cause`` is a ContextLengthError or a ValueError)."""
    requests = []
    for index, prompt in enumerate(prompts):
        try:
            max_tokens = validate_request(info, prompt, params)
        except SamplingParamError:
            raise  # the parameters, not this prompt
        except ValueError as exc:
            raise PromptError(index, exc) from None
        for choice in range(params.n):
            seed = None if params.seed is None else choice_seed(params.seed, choice)
            one = params if params.n == 1 else dataclasses.replace(params, n=1, seed=seed)
            requests.append(EngineRequest(new_id(), list(prompt), one, max_tokens, arrival_time, cache_salt, priority,
                                          cache_scope))
    return requests
