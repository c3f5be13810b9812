"""The scheduling policy. Pure Python: never imports torch.

There are no phases. Every request has ``num_computed_tokens``; each step hands out new tokens, running
requests first (in admission order) then waiting ones, until each catches up with its known tokens or the
step's token budget is spent. A prompt longer than the remaining budget gets a chunk (chunked prefill); a
decode is a chunk of one. When the KV pool cannot cover a running request's chunk, the most recently admitted
running request is preempted: its blocks are freed and it goes to the front of the waiting queue, to be
recomputed from its prompt and the outputs it already has.

Priorities (scheduler/priority.py) order both queues: interactive requests before batch ones, so the budget goes to
them first and preemption takes batch work first; while an interactive request waits or is in its prompt, running
batch requests sit the step out, and it may preempt one for its seat or its blocks.

Admission looks up the request's leading full blocks in the prefix cache first (kvcache/manager.py): the blocks
found become its computed prefix, so a prefix hit is just a request that starts with ``num_computed_tokens > 0``.
After each step, the blocks a step completed are offered to the cache, then a sliding-window group's blocks that the
next query's window no longer reaches go back to the pool (kvcache/groups.py: a request holds one block table per KV
group).

Speculative decoding is the same rule with more known tokens: a decoding request with draft tokens
(``spec_token_ids``, proposed by the runner's proposer in the last step) is scheduled for its last token plus the
drafts; the runner samples at every one of those positions and returns the accepted drafts plus one token of its own.
``update_from_output`` then takes back the computed count of the rejected drafts (their KV slots are overwritten by
the next step, and blocks that only held them go back to the pool). A drafter inside the model (DeepSeek's MTP) writes its own
cache a few positions past a request's scheduled tokens: ``num_lookahead_tokens`` reserves those slots for each
request that samples, from blocks left free once the step is scheduled (never at the cost of a preemption).

The runner hears of all this only through ``SchedulerOutput`` (scheduler/output.py): a request enters its batch
when admitted, sends block diffs while it runs, and leaves when it finishes, is aborted or is preempted.

``update_from_output`` is the one place a request changes after it is scheduled: its new tokens, its stops (token
stops here; stop strings and a grammar's completion as the engine's reporters found them), its drafts for the next
step, its first-token time and its finish. A request whose grammar is still being prepared (``blocked``) is passed
over by ``schedule`` until it is ready, and keeps its place.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.scheduler.output import (Kept, NewRequestData, OutputReports, RunnerOutput, RunningRequestData,
                                       SchedulerOutput, Stop)
from tokenmill.scheduler.priority import insert_by_priority, yielding_above
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.scheduler.stats import SchedulerStats, SpecStats


class DuplicateRequestError(ValueError):
    """A request id the scheduler already holds: nothing was queued, nothing changed."""


@dataclass
class RequestUpdate:
    """A request after a step (finished ones included) and the tokens it kept in that step."""
    request: Request
    new_token_ids: list[int]


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
        """Queue a request; if this raises (DuplicateRequestError, or anything else), nothing has changed."""
        if request.request_id in self.requests:
            raise DuplicateRequestError(f"duplicate request id {request.request_id!r}")
        insert_by_priority(self.waiting, request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self, blocked: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        """One step's work; requests in ``blocked`` are passed over (running ones keep their blocks, waiting ones
        their place in the queue)."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        now = time.monotonic()
        yielding = yielding_above(self.running, self.waiting, blocked)  # scheduler/priority.py

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.request_id in blocked or (yielding is not None and request.priority > yielding):
                i += 1
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            known_blocks = self.kv.num_blocks_of(request)
            drafts = self._drafts(request, n, budget)
            if drafts and not self.kv.allocate_slots(request, n + len(drafts)):
                drafts = []  # drafts are verified only where they fit: they never cost a preemption
            n += len(drafts)
            if not self._make_room(request, n, out):
                break  # `request` itself was preempted; every request after it too.
            out.running.append(RunningRequestData(
                request.request_id, [table[known_blocks:] for table in request.block_tables],
                request.num_computed_tokens, self.kv.num_blocks_of(request), self.kv.live_from(request)))
            out.num_scheduled_tokens[request.request_id] = n
            if drafts:
                out.spec_token_ids[request.request_id] = drafts
            budget -= n
            i += 1

        # Admitting while preempting would only thrash: wait for a step that needs no preemption.
        admissible = [] if out.preempted_ids else [r for r in self.waiting if r.request_id not in blocked]
        for request in admissible:
            if budget <= 0:
                break
            if len(self.running) >= self.max_num_seqs and not self._preempt_lower(request, out):
                break
            hits = [] if request.needs_every_position else self.kv.find_cached_prefix(request)
            num_hit_tokens = len(hits[0]) * self.kv.block_size if hits else 0
            n = min(request.num_tokens - num_hit_tokens, budget)
            admitted = self.kv.allocate_slots(request, n, hits)
            while not admitted and self._preempt_lower(request, out):
                admitted = self.kv.allocate_slots(request, n, hits)
            if not admitted:
                break
            self.waiting.remove(request)
            self.kv.record_prefix_query(request.num_tokens, num_hit_tokens)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = num_hit_tokens
            insert_by_priority(self.running, request)
            out.new_requests.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens, request.sampling_params,
                [list(table) for table in request.block_tables], request.num_computed_tokens))
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
            known = self.kv.num_blocks_of(request)
            samples = request.num_computed_tokens + n >= request.num_tokens
            if not samples or not self.kv.allocate_slots(request, n + self.num_lookahead_tokens):
                continue
            if self.kv.num_blocks_of(request) == known:
                continue
            added = [table[known:] for table in request.block_tables]
            if isinstance(diff, NewRequestData):
                for table, more in zip(diff.block_tables, added):
                    table.extend(more)
            else:
                diff.new_block_ids = [old + more for old, more in zip(diff.new_block_ids, added)]
                diff.num_blocks = self.kv.num_blocks_of(request)

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

    def _preempt_lower(self, request: Request, out: SchedulerOutput) -> bool:
        """Preempt the lowest-priority running request if its priority is below ``request``'s (it sat this step out:
        scheduler/priority.py), to give ``request`` its seat or blocks; False if there is none."""
        if not self.running or self.running[-1].priority <= request.priority:
            return False
        victim = self.running.pop()
        self._preempt(victim)
        out.preempted_ids.append(victim.request_id)
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.pooled_sum, request.num_pooled = None, 0  # pooled again from the recomputed prefill
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        insert_by_priority(self.waiting, request, first=True)

    def kept_tokens(self, result: RunnerOutput) -> dict[str, Kept]:
        """Each sampling request's tokens as far as its token stops let it keep them (read only: what the reporters
        read before ``update_from_output`` applies everything)."""
        kept = {}
        for request_id, tokens in result.sampled.items():
            request = self.requests.get(request_id)
            if request is not None:
                stop = request.first_token_stop(tokens)
                kept[request_id] = Kept(tokens[:stop[0] + 1], True) if stop else Kept(list(tokens), False)
        return kept

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput, reports: OutputReports,
                           now: float | None = None) -> list[RequestUpdate]:
        """Apply one step: advance each scheduled request past its computed tokens, less its rejected drafts; append
        its sampled tokens up to the first that ends it -- a token stop, or a reporter's stop (a stop string or the
        grammar's completion; at the same token, the reporter's stop and its reason win); set its drafts for the next
        step, its first-token time, its finish. Errors come first (such a request keeps nothing of the step), late
        grammar completions (of requests not scheduled now) last. Returns what changed: each request's state and the
        tokens it kept."""
        now = time.monotonic() if now is None else now
        updates = []
        for request_id, error in reports.errors.items():  # first: an errored request keeps nothing of this step
            if (request := self.fail(request_id, error)) is not None:
                updates.append(RequestUpdate(request, []))
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            if (prompt := result.prompt_logprobs.get(request_id)) is not None:  # a preempted prefill overwrites
                start, entries = prompt
                request.prompt_logprobs[start:start + len(entries)] = entries
            if (pooled := result.pooled.get(request_id)) is not None:
                total, count = pooled
                request.pooled_sum = total if request.pooled_sum is None else \
                    [a + b for a, b in zip(request.pooled_sum, total)]
                request.num_pooled += count
            tokens = self._advance(request, num_tokens, out.spec_token_ids.get(request_id), result)
            kept, status = self._append(request, tokens, reports.stops.get(request_id))
            if kept and request.first_token_time is None:
                request.first_token_time = now
            if status is None and request_id in result.sampled:
                request.spec_token_ids = reports.drafts.get(request_id, result.drafts.get(request_id, []))
            self.kv.cache_computed_blocks(request)
            self.kv.free_behind_window(request)
            if status is not None:
                self.finish(request, status)
            if request_id in result.sampled:
                updates.append(RequestUpdate(request, kept))
        for request_id in reports.completed:
            if (request := self.requests.get(request_id)) is not None:
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                updates.append(RequestUpdate(request, []))
        return updates

    def _advance(self, request: Request, num_tokens: int, drafts: list[int] | None, result: RunnerOutput) -> list[int]:
        """Count the step's computed tokens, less the rejected drafts (blocks that held only those go back); returns
        the tokens sampled for the request (empty for a prefill chunk that samples nothing)."""
        request.spec_token_ids = []
        tokens = result.sampled.get(request.request_id, [])
        num_rejected = len(drafts) - (len(tokens) - 1) if drafts else 0
        request.num_computed_tokens += num_tokens - num_rejected
        if drafts:
            self.spec.record(len(drafts), len(tokens) - 1)
            self.kv.release_tail(request)
        return tokens

    @staticmethod
    def _append(request: Request, tokens: list[int], reported: Stop | None) -> tuple[list[int], RequestStatus | None]:
        """Append ``tokens`` up to the first stop; returns the kept tokens and the status that ends the request. A stop
        string wins over a token stop at its own token (its reason is the one reported); a grammar's completion at
        the token stop's own token leaves the token stop's status (a complete output at max_tokens is "length")."""
        token_stop = request.first_token_stop(tokens)
        end, status, reason = (token_stop[0] + 1, token_stop[1], token_stop[2]) if token_stop \
            else (len(tokens), None, None)
        if reported is not None and (reported.reason is not None or status is None or reported.index < end - 1):
            end, status, reason = reported.index + 1, RequestStatus.FINISHED_STOPPED, reported.reason
        if reason is not None:
            request.stop_reason = reason
        kept = tokens[:end]
        for token in kept:
            request.append_output_token(token)
        if status is not None:  # accepted drafts after a stop are dropped, and so is their KV
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        return kept, status

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

    def fail(self, request_id: str, error: str) -> Request | None:
        """End a request with an error (``error``: what its client is told) wherever it is; its blocks return to the
        pool. None if it has already ended."""
        request = self.requests.get(request_id)
        if request is not None:
            request.error = error
            self.finish(request, RequestStatus.FINISHED_ERROR)
        return request

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
        pool = self.kv.pool
        pool.check_integrity()
        holders = [0] * pool.num_blocks
        for request in self.running:
            self.kv.check_tables(request, holders)
        for request in self.waiting:
            assert not request.block_tables and request.num_computed_tokens == 0, "a waiting request holds blocks"
        assert holders == [b.ref_cnt for b in pool.blocks], "reference counts differ from the holders"
