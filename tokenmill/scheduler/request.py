"""The one object that flows through the engine: a request, its tokens, its blocks and its timing marks. Only the
scheduler changes one (scheduler/scheduler.py); everything else reads it or reports to the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # refused while running (a grammar over its budget): the API answers with an error

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Largest number of output tokens, after capping by the model length.
    max_tokens: int
    # Every id that ends generation (the model's EOS ids), unless sampling_params.ignore_eos.
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    # Requests share cached prefix blocks only when their salts are equal (vLLM's cache_salt, per tenant).
    cache_salt: str | None = None
    # Lower first: 0 interactive, 1 batch (scheduler/priority.py).
    priority: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Invariant: all_token_ids == prompt_token_ids + output_token_ids.
    all_token_ids: list[int] = field(init=False)
    # Tokens whose K/V sit in the cache; 0 after a preemption (recompute).
    num_computed_tokens: int = 0
    # Physical KV blocks per KV group (kvcache/groups.py), in logical order; they cover at least num_computed_tokens.
    # [] while it holds none.
    block_tables: list[list[int]] = field(default_factory=list)
    num_preemptions: int = 0
    # Prefix caching (kvcache/manager.py): hashes of the full blocks of all_token_ids seen so far; how many leading
    # blocks are in the prefix cache; prompt tokens found cached when first admitted (usage.cached_tokens).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = 0
    # Prompt logprobs (sampling_params.prompt_logprobs): one entry per prompt token, None until computed (the first
    # token's stays None: nothing predicts it); sent with the request's first output.
    prompt_logprobs: list | None = None
    # Embeddings (sampling_params.pooling): the sum of the pooled hidden states so far and how many; a preemption
    # starts it over with the prefill.
    pooled_sum: list[float] | None = None
    num_pooled: int = 0
    # Draft tokens to verify in the next step (speculative decoding); proposed after each step, consumed by the next.
    spec_token_ids: list[int] = field(default_factory=list)
    # What stopped the request: a token id, a stop string, or None (EOS, length, abort, a complete grammar output).
    stop_reason: int | str | None = None
    # Why the request ended with FINISHED_ERROR.
    error: str | None = None

    # Timing marks (time.monotonic()).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def needs_every_position(self) -> bool:
        """Its prompt's positions are all read (prompt logprobs, mean or CLS pooling): no prefix-cache hit may skip
        them. Last-token pooling reads only the last, which is always computed."""
        return self.prompt_logprobs is not None or self.sampling_params.pooling in ("mean", "cls")

    @property
    def embedding(self) -> list[float] | None:
        if self.pooled_sum is None or not self.num_pooled:
            return None
        return [value / self.num_pooled for value in self.pooled_sum]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` outputs (a stop string ended the request before the rest)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def first_token_stop(self, new_token_ids: list[int]) -> tuple[int, RequestStatus, int | None] | None:
        """Where appending ``new_token_ids`` would end the request by a token stop, without changing it: (index of the
        token that ends it, the status, the stop reason -- a stop token id, or None for EOS and length). Stop strings
        and grammars are the reporters' (scheduler/output.py's OutputReports)."""
        params = self.sampling_params
        for i, token in enumerate(new_token_ids):
            num_outputs = self.num_output_tokens + i + 1
            if num_outputs >= params.min_tokens:
                if not params.ignore_eos and token in self.eos_token_ids:
                    return i, RequestStatus.FINISHED_STOPPED, None
                if token in params.stop_token_ids:
                    return i, RequestStatus.FINISHED_STOPPED, token
            if num_outputs >= self.max_tokens:
                return i, RequestStatus.FINISHED_LENGTH, None
        return None
