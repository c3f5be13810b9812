"""The scheduling policy. Pure Python: never imports torch.

There are no phases. Every request has ``num_computed_tokens``; each step hands out new tokens, running
requests first (in admission order) then waiting ones, until each catches up with its known tokens or the
step's token budget is spent. A prompt longer than the remaining budget gets a chunk (chunked prefill); a
decode is a chunk of one. When the KV pool cannot cover a running request's chunk, the most recently admitted
running request is preempted: its blocks are freed and it goes to the front of the waiting queue, to be
recomputed from its prompt and the outputs it already has.

The runner hears of all this only through ``SchedulerOutput`` (scheduler/output.py): a request enters its batch
when admitted, sends block diffs while it runs, and leaves when it finishes, is aborted or is preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.scheduler.output import NewRequestData, RunningRequestData, SchedulerOutput
from tokenmill.scheduler.request import Request, RequestStatus


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
        self._finished_ids: list[str] = []  # finished or aborted since the last schedule(): the runner drops them

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            known_blocks = len(request.block_ids)
            if not self._make_room(request, n, out):
                break  # `request` itself was preempted; every request after it too.
            out.running.append(RunningRequestData(request.request_id, request.block_ids[known_blocks:],
                                                  request.num_computed_tokens))
            out.num_scheduled_tokens[request.request_id] = n
            budget -= n
            i += 1

        # Admitting while preempting would only thrash: wait for a step that needs no preemption.
        while not out.preempted_ids and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request, n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            out.new_requests.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens, request.sampling_params,
                list(request.block_ids), request.num_computed_tokens))
            out.num_scheduled_tokens[request.request_id] = n
            budget -= n
        return out

    def _make_room(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for ``request``, preempting from the back of ``running``; False if it was the victim."""
        while not self.kv.allocate_slots(request, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
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
        """Advance each scheduled request past its computed tokens; append the token sampled for it, if any.
        Returns the requests that a token stop (EOS, stop token, length) finished here."""
        finished = []
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.num_computed_tokens += num_tokens
            token = sampled.get(request_id)
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
        self._finished_ids.append(request.request_id)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions_total)
