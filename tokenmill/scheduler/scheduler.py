"""The scheduling policy. Pure Python: never imports torch.

There are no phases. Every request has ``num_computed_tokens``; each step hands out new tokens, running
requests first (in admission order) then waiting ones, until each catches up with its known tokens or the
step's token budget is spent. A prompt longer than the remaining budget gets a chunk (chunked prefill); a
decode is a chunk of one. When the KV pool cannot cover a running request's chunk, the most recently admitted
running request is preempted: its blocks are freed and it goes to the front of the waiting queue, to be
recomputed from its prompt and the outputs it already has.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.scheduler.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    # Tokens all_token_ids[start : start + num_tokens] are computed this step.
    start: int
    num_tokens: int
    # True when this chunk reaches the last known token, so the step samples the next one.
    samples: bool

    @classmethod
    def next_for(cls, request: Request, num_tokens: int) -> "ScheduledChunk":
        start = request.num_computed_tokens
        return cls(request, start, num_tokens, start + num_tokens == request.num_tokens)


@dataclass
class SchedulerOutput:
    """The only contract between the scheduler and the model runner."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, n, out):
                break  # `request` itself was preempted; every request after it too.
            out.chunks.append(ScheduledChunk.next_for(request, n))
            budget -= n
            i += 1

        # Admitting while preempting would only thrash: wait for a step that needs no preemption.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request, n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            out.chunks.append(ScheduledChunk.next_for(request, n))
            budget -= n
        return out

    def _make_room(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for ``request``, preempting from the back of ``running``; False if it was the victim."""
        while not self.kv.allocate_slots(request, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance each scheduled request; append the tokens sampled for it. Returns requests finished here."""
        finished = []
        for chunk in out.chunks:
            request = chunk.request
            if request.is_finished:
                continue
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            status = request.check_token_stop()
            if status is not None:
                self.finish(request, status)
                finished.append(request)
        return finished

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request wherever it is; its blocks return to the pool. Idempotent."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        request.finished_time = time.monotonic()
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions_total)
