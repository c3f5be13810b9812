"""The engine's grammars, off the step loop: a constrained request's grammar work -- compiling its grammar, then after
each step accepting the tokens it kept and computing the allowed tokens of its next step -- runs as a job on a worker
thread (xgrammar releases the GIL in all of it), so the step loop never waits on one request's grammar.

A request is ``busy`` while its job runs, and the scheduler passes over it. The loop waits for a job only up to a
grace period (a fraction of the step time, ``grace_for``) and only while the request's grammar has been fast: the
common case (well under a millisecond) is applied in the step it belongs to, exactly as if it ran inline, and a slow
grammar's request waits for its own job while every other request goes on. A job that runs longer than
``timeout_s``, or a compiled grammar larger than ``max_bytes``, ends its request with an error. The job stops itself
at its next xgrammar call after the deadline; a call itself cannot be interrupted, so its thread is left to finish
that call and its result is dropped. The API side refuses most such grammars before they reach the engine
(structured/checker.py), in a process it can kill.

Invariants: a request has at most one job at a time, and its matcher (under a key of its own, never reused, so a
stale job cannot touch a later request of the same id) is touched only by that job; a job's result is taken on the
loop's thread. A request is schedulable only with masks ready: for the next step's known position and after each of
the drafts the grammar accepted (the scheduler schedules a prefix). A job's findings count for the step whose
``advance`` started it only when that ``advance`` collects it; collected any later, they are late.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from tokenmill.engine.threads import DaemonPool
from tokenmill.scheduler.output import GrammarOutput, Kept, SchedulerOutput
from tokenmill.structured.grammar import GrammarError, GrammarTimeout, check_deadline
from tokenmill.structured.matchers import ZONE, GrammarMatchers
from tokenmill.structured.spec import GrammarSpec

log = logging.getLogger(__name__)

# The step loop waits for a fast grammar's job at most this fraction of a step, and at least MIN_GRACE_S.
GRACE_FRACTION, MIN_GRACE_S = 0.25, 0.002
# Threads are added while all are busy (one may be stuck in a call that cannot be interrupted), up to this many.
MAX_WORKERS = 32


def grace_for(step_seconds: float) -> float:
    return max(MIN_GRACE_S, GRACE_FRACTION * step_seconds)


@dataclass
class _Result:
    complete_at: int | None = None  # index of the kept token after which the output is complete
    drafts: list[int] = field(default_factory=list)  # the drafts the grammar accepts for the next step
    mask: np.ndarray | None = None  # [1 + len(drafts), width] int32; None when the request ends


@dataclass
class _Grammar:
    key: str  # its matcher's key: the request id and a serial number
    spec: GrammarSpec
    max_tokens: int
    outputs: list[int] = field(default_factory=list)  # tokens the matcher accepted (the output so far)
    job: Future | None = None
    job_step: int = 0  # the advance() that started the job (0: the compile)
    submitted: float = 0.0  # when the job was handed to the pool
    started: float | None = None  # when the job began running (set on its thread)
    seconds: float = 0.0  # how long the last job ran
    fast: bool = True  # its last job finished within the grace
    result: _Result | None = None


@dataclass
class GrammarFindings:
    """What ``advance`` found: for this step's kept tokens, the index after which each output is complete and the
    drafts its grammar accepts; and late, from jobs that finished after their step, completions and errors."""
    complete_at: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)


class GrammarService:
    def __init__(self, matchers: GrammarMatchers, timeout_s: float, max_bytes: int, max_workers: int = MAX_WORKERS):
        self.matchers = matchers
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self._pool = DaemonPool(max_workers, "tokenmill-grammar")
        self._grammars: dict[str, _Grammar] = {}
        self._completed: set[str] = set()  # found complete late, not yet reported
        self._errors: dict[str, str] = {}  # not yet reported
        self._step = 0
        self._serial = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._grammars

    @property
    def busy(self) -> set[str]:
        """Requests the scheduler must pass over: a job running, no masks ready, or a finding not yet reported."""
        if not self._grammars and not self._completed and not self._errors:
            return set()
        unready = {rid for rid, g in self._grammars.items()
                   if g.job is not None or g.result is None or g.result.mask is None}
        return unready | self._completed | set(self._errors)

    @property
    def pending(self) -> bool:
        return any(g.job is not None for g in self._grammars.values())

    def add(self, request_id: str, spec: GrammarSpec, max_tokens: int) -> None:
        """Start compiling the request's grammar; it is busy until its first masks are ready."""
        grammar = _Grammar(f"{request_id}#{next(self._serial)}", spec, max_tokens)
        self._grammars[request_id] = grammar
        self._start(grammar, 0, self._prepare, grammar)

    def remove(self, request_id: str) -> None:
        grammar = self._grammars.pop(request_id, None)
        self._completed.discard(request_id)
        self._errors.pop(request_id, None)
        if grammar is not None:
            self._forget(grammar)

    def _forget(self, grammar: _Grammar) -> None:
        """Drop a grammar's matcher; a queued job is cancelled, a running one keeps it until its call returns."""
        if grammar.job is not None and not grammar.job.cancel():
            grammar.job.add_done_callback(lambda _: self.matchers.remove(grammar.key))
        else:
            self.matchers.remove(grammar.key)

    def close(self) -> None:
        self._pool.close()

    # --- the step loop's side
    def masks(self, out: SchedulerOutput) -> GrammarOutput:
        """The allowed tokens of each scheduled constrained request, at its known position and after each of the
        drafts scheduled for it."""
        bitmasks = {}
        for request_id in out.num_scheduled_tokens:
            grammar = self._grammars.get(request_id)
            if grammar is not None and grammar.result is not None and grammar.result.mask is not None:
                bitmasks[request_id] = grammar.result.mask[:1 + len(out.spec_token_ids.get(request_id, []))]
        return GrammarOutput(bitmasks)

    def advance(self, kept: dict[str, Kept], drafts: dict[str, list[int]], grace_s: float) -> GrammarFindings:
        """Start each constrained request's job over its kept tokens (and the proposer's drafts for it), wait up to
        ``grace_s`` for the fast ones, and report what is known."""
        self._step += 1
        if not self._grammars and not self._completed and not self._errors:
            return GrammarFindings()  # no constrained request: the common step
        started = []
        for request_id, k in kept.items():
            grammar = self._grammars.get(request_id)
            if grammar is not None and grammar.job is None:
                self._start(grammar, self._step, self._advance, grammar, k.token_ids, k.finishing,
                            drafts.get(request_id, []))
                started.append(request_id)
        self._wait_fast(grace_s)
        self._collect(grace_s, this_step=self._step)
        findings = GrammarFindings(completed=self._completed, errors=self._errors)
        self._completed, self._errors = set(), {}
        for request_id in started:
            grammar = self._grammars.get(request_id)
            if grammar is None or grammar.job is not None:  # failed, or late: no drafts until it is done
                findings.drafts[request_id] = []
                continue
            findings.drafts[request_id] = grammar.result.drafts
            if grammar.result.complete_at is not None:
                findings.complete_at[request_id] = grammar.result.complete_at
        return findings

    def wait(self, grace_s: float) -> None:
        """Before scheduling: wait up to ``grace_s`` for the running jobs of requests whose grammar has been fast, then
        take every finished job's result (all late now) and end the requests whose job is over its time."""
        if not self._grammars:
            return
        self._wait_fast(grace_s)
        self._collect(grace_s, this_step=None)

    def wait_any(self, timeout_s: float) -> None:
        """Nothing else can run: block until some job finishes (or ``timeout_s``)."""
        running = [g.job for g in self._grammars.values() if g.job is not None]
        if running:
            concurrent.futures.wait(running, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
        self._collect(0.0, this_step=None)

    def _wait_fast(self, grace_s: float) -> None:
        fast = [g.job for g in self._grammars.values() if g.job is not None and g.fast]
        if fast:
            concurrent.futures.wait(fast, timeout=grace_s)

    def _collect(self, grace_s: float, this_step: int | None) -> None:
        """Take finished jobs' results; those of jobs started by the advance() numbered ``this_step`` belong to it,
        any other's completion is late (reported on its own)."""
        now = time.monotonic()
        for request_id, grammar in list(self._grammars.items()):
            job = grammar.job
            if job is None:
                continue
            if not job.done():
                grammar.fast = False
                if now - (grammar.started or grammar.submitted) > self.timeout_s:  # running, or queued that long
                    self._fail(request_id, self._timeout_message(grammar))
                continue
            grammar.job = None
            try:
                grammar.result = job.result()
            except GrammarTimeout:
                self._fail(request_id, self._timeout_message(grammar))
                continue
            except Exception as exc:  # noqa: BLE001 - GrammarError, or anything xgrammar raises: the request's own
                self._fail(request_id, str(exc) if isinstance(exc, GrammarError) else f"{type(exc).__name__}: {exc}")
                continue
            grammar.fast = grammar.seconds <= max(grace_s, MIN_GRACE_S)
            if grammar.job_step != this_step and grammar.result.complete_at is not None:
                self._completed.add(request_id)

    def _timeout_message(self, grammar: _Grammar) -> str:
        what = "for one step" if grammar.job_step else "to compile"
        return f"its grammar took more than {self.timeout_s:g} s {what} (this server's grammar_timeout)"

    def _fail(self, request_id: str, message: str) -> None:
        log.warning("request %s: %s", request_id, message)
        self._errors[request_id] = message
        self._forget(self._grammars.pop(request_id))

    # --- the jobs (worker threads)
    def _start(self, grammar: _Grammar, step: int, work, *args) -> None:
        """Run ``work(*args)`` as the request's job, for advance() number ``step`` (0: the compile)."""
        grammar.started, grammar.job_step, grammar.submitted = None, step, time.monotonic()
        grammar.job = self._pool.submit(self._timed, grammar, work, *args)

    @staticmethod
    def _timed(grammar: _Grammar, work, *args) -> _Result:
        grammar.started = time.monotonic()
        try:
            return work(*args)
        finally:
            grammar.seconds = time.monotonic() - grammar.started

    def _prepare(self, grammar: _Grammar) -> _Result:
        self.matchers.add(grammar.key, grammar.spec, max_bytes=self.max_bytes, deadline=self._deadline(grammar))
        return self._next_masks(grammar, [])

    def _deadline(self, grammar: _Grammar) -> float:
        return grammar.started + self.timeout_s

    def _advance(self, grammar: _Grammar, tokens: list[int], finishing: bool, drafts: list[int]) -> _Result:
        deadline = self._deadline(grammar)
        for i, token in enumerate(tokens):
            check_deadline(deadline)
            grammar.outputs.append(token)
            if self.matchers.accept(grammar.key, [token]):
                return _Result(complete_at=i)
        return _Result() if finishing else self._next_masks(grammar, drafts)

    def _next_masks(self, grammar: _Grammar, drafts: list[int]) -> _Result:
        """The drafts to verify next (none near max_tokens: steering, not drafting) and the masks of the next step;
        near max_tokens, the one token that steers the output to a complete document in time."""
        key, tokens_left = grammar.key, grammar.max_tokens - len(grammar.outputs)
        drafts = [] if tokens_left <= ZONE else self.matchers.valid_drafts(key, drafts)
        steered = None if drafts else self.matchers.steer(key, tokens_left, grammar.outputs, self._deadline(grammar))
        return _Result(drafts=drafts, mask=steered if steered is not None else self.matchers.bitmask(key, drafts))
