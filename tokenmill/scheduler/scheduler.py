"""The scheduling policy. Pure Python: never imports torch.

There are no phases. Every request has ``num_computed_tokens``; each step hands out new tokens, running
requests first (in admission order) then waiting ones, until each catches up with its known tokens or the
step's token budget is spent. A prompt longer than the remaining budget gets a chunk (chunked prefill); a
decode is a chunk of one. When the KV pool cannot cover a running request's chunk, the most recently admitted
running request is preempted: its blocks are freed and it goes to the front of the waiting queue, to be
recomputed from its prompt and the outputs it already has.

Admission looks up the request's leading full blocks in the prefix cache first (kvcache/manager.py): the blocks
found become its computed prefix, so a prefix hit is just a request that starts with ``num_computed_tokens > 0``.
After each step, the blocks a step completed are offered to the cache.

Speculative decoding is the same rule with more known tokens: a decoding request with draft tokens
(``spec_token_ids``, proposed by the engine after the last step) is scheduled for its last token plus the drafts;
the runner samples at every one of those positions and returns the accepted drafts plus one token of its own.
``update`` then takes back the computed count of the rejected drafts (their KV slots are overwritten by the next
step, and blocks that only held them go back to the pool). A drafter inside the model (DeepSeek's MTP) writes its own
cache a few positions past a request's scheduled tokens: ``num_lookahead_tokens`` reserves those slots for each
request that samples, from blocks left free once the step is scheduled (never at the cost of a preemption).

The runner hears of all this only through ``SchedulerOutput`` (scheduler/output.py): a request enters its batch
when admitted, sends block diffs while it runs, and leaves when it finishes, is aborted or is preempted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.scheduler.output import NewRequestData, RunningRequestData, SchedulerOutput
from tokenmill.scheduler.request import Request, RequestStatus


@dataclass
class SpecStats:
    """Speculative decoding counters: drafts verified and accepted, in all and by draft position (0 = first);
    accepted / drafted at a position is the acceptance rate there."""
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens_total += num_drafts
        self.num_accepted_tokens_total += num_accepted
        for counts in (self.drafted_by_position, self.accepted_by_position):
            if len(counts) < num_drafts:
                counts += [0] * (num_drafts - len(counts))
        for position in range(num_drafts):
            self.drafted_by_position[position] += 1
            self.accepted_by_position[position] += position < num_accepted


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    spec: SpecStats


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_tokens: int = 0):
        self.kv = kv
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.spec = SpecStats()
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
            drafts = self._drafts(request, n, budget)
            if drafts and not self.kv.allocate_slots(request, n + len(drafts)):
                drafts = []  # drafts are verified only where they fit: they never cost a preemption
            n += len(drafts)
            if not self._make_room(request, n, out):
                break  # `request` itself was preempted; every request after it too.
            out.running.append(RunningRequestData(request.request_id, request.block_ids[known_blocks:],
                                                  request.num_computed_tokens, len(request.block_ids)))
            out.num_scheduled_tokens[request.request_id] = n
            if drafts:
                out.spec_token_ids[request.request_id] = drafts
            budget -= n
            i += 1

        # Admitting while preempting would only thrash: wait for a step that needs no preemption.
        while not out.preempted_ids and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = self.kv.find_cached_prefix(request)
            num_hit_tokens = len(hits) * self.kv.block_size
            n = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, n, hits):
                break
            self.waiting.popleft()
            self.kv.record_prefix_query(request.num_tokens, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            out.new_requests.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens, request.sampling_params,
                list(request.block_ids), request.num_computed_tokens))
            out.num_scheduled_tokens[request.request_id] = n
            budget -= n
        if self.num_lookahead_tokens:
            self._reserve_lookahead(out)
        return out

    def _reserve_lookahead(self, out: SchedulerOutput) -> None:
        """Best effort, after everything is scheduled: blocks for ``num_lookahead_tokens`` slots past the scheduled
        tokens of each request that samples this step, added to its diff."""
        diffs = {d.request_id: d for d in (*out.new_requests, *out.running)}
        for request_id, n in out.num_scheduled_tokens.items():
            request, diff = self.requests[request_id], diffs[request_id]
            known = len(request.block_ids)
            samples = request.num_computed_tokens + n >= request.num_tokens
            if not samples or not self.kv.allocate_slots(request, n + self.num_lookahead_tokens):
                continue
            added = request.block_ids[known:]
            if isinstance(diff, NewRequestData):
                diff.block_ids.extend(added)
            elif added:
                diff.new_block_ids = diff.new_block_ids + added
                diff.num_blocks = len(request.block_ids)

    @staticmethod
    def _drafts(request: Request, num_new_tokens: int, budget: int) -> list[int]:
        """The drafts a decoding request verifies this step: within the budget, and never past max_tokens."""
        if num_new_tokens != 1 or not request.spec_token_ids:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[:max(0, room)]

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

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance each scheduled request past its computed tokens, less its rejected drafts; append the tokens
        sampled for it (accepted drafts, then the runner's own), stopping at the first that ends it.
        Returns the requests that a token stop (EOS, stop token, length) finished here."""
        finished = []
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.spec_token_ids = []
            tokens = sampled.get(request_id, [])
            drafts = out.spec_token_ids.get(request_id)
            num_rejected = len(drafts) - (len(tokens) - 1) if drafts else 0
            request.num_computed_tokens += num_tokens - num_rejected
            if drafts:
                self.spec.record(len(drafts), len(tokens) - 1)
                self.kv.release_tail(request)
            status = None
            for token in tokens:
                request.append_output_token(token)
                status = request.check_token_stop()
                if status is not None:  # accepted drafts after a stop are dropped, and so is their KV
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                    break
            self.kv.cache_computed_blocks(request)
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
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, self.num_preemptions_total,
                              self.kv.prefix_queries_total, self.kv.prefix_hits_total, self.spec)

    def check_integrity(self) -> None:
        """Assert the invariants between requests and the pool: every block's reference count is the number of
        running requests holding it; waiting requests hold none; a running request's blocks cover its computed
        tokens, and its leading cached blocks hold exactly its tokens."""
        pool, size = self.kv.pool, self.kv.block_size
        pool.check_integrity()
        holders = [0] * pool.num_blocks
        for request in self.running:
            assert len(set(request.block_ids)) == len(request.block_ids), "a request holds a block twice"
            assert len(request.block_ids) * size >= request.num_computed_tokens, "computed tokens without blocks"
            for i, block_id in enumerate(request.block_ids):
                holders[block_id] += 1
                block = pool.blocks[block_id]
                if i < request.num_cached_blocks and block.token_ids is not None:
                    assert list(block.token_ids) == request.all_token_ids[i * size:(i + 1) * size], "cache mismatch"
        for request in self.waiting:
            assert not request.block_ids and request.num_computed_tokens == 0, "a waiting request holds blocks"
        assert holders == [b.ref_cnt for b in pool.blocks], "reference counts differ from the holders"
