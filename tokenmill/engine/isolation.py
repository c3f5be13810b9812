"""A failure stays in its request: the engine step's guard around the model runner, and what a failed request is told.

A step's runner work comes in two halves (engine/runner.py). ``update_batch`` applies the scheduler's diff row by row:
a request whose row cannot be set (its sampling parameters overflow the batch's arrays, say) loses its row and is
returned with its exception. ``compute`` runs the forward, sampling and drafting of a set of the step's requests as one
batched call, and is transactional -- the invariant this module rests on: when it raises, the batch is as before the
call (the KV slots it wrote are the same positions', which a rerun writes again with the same values). So a failed
step is bisected: its requests, in the scheduler's order, split in halves; a half that succeeds keeps its outputs, a
half that fails splits again, and a request that fails alone is pinned. The hot path is one call inside one try; the
bisection runs only after a failure (about 2 log2(n) more computes for one bad request among n).

A pinned request ends alone: the engine core reports it in ``OutputReports.errors``, so the scheduler finishes it with
FINISHED_ERROR and frees its blocks, and the runner drops its row with the next diff (at once when its row could not
be set); the rest of the step goes on. Its client is told ``failure_message`` only; the exception, with its traceback
and the request id, goes to the log at ERROR.

Unpinnable, raised as the step's failure (the engine process then dies and is restarted, as for any engine fault):
every request of a step of two or more failing alone (the fault is the step's or the model's, not theirs), and
``MAX_FAILING_STEPS`` consecutive steps whose computed requests all failed alone (one request per step cannot show
that by itself). Under tensor parallelism the engine core does not use this guard (``EngineCore.step``): the worker
ranks run each step's runner work in lockstep with rank 0's collectives, and a retry on rank 0 alone would leave them
waiting in another, so any failure of the runner there is the engine's. So is a failure in the scheduler's own work
(``schedule``, ``update_from_output``: policy over every request, which a failure leaves half applied).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from tokenmill.engine.messages import RequestOutput
from tokenmill.scheduler.output import GrammarOutput, RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tokenmill.engine.runner import ModelRunner

log = logging.getLogger(__name__)

MAX_FAILING_STEPS = 3


def failure_message(request_id: str) -> str:
    """All the request's client learns: no exception text (it may name internal paths or other requests' data)."""
    return f"the engine could not run this request (request id {request_id})"


def error_code(request_id: str, error: str | None) -> str | None:
    """The kind of a request's error for the API (RequestOutput.error_code): the engine's own failure while serving
    it, else the only other way a request ends with one (its grammar over the server's budget, engine/grammar.py)."""
    if error is None:
        return None
    return "engine_error" if error == failure_message(request_id) else "grammar_too_costly"


def log_failure(request_id: str, stage: str, exc: BaseException) -> None:
    log.error("request %s failed while %s; it ends with an error, the engine goes on", request_id, stage,
              exc_info=exc)


def error_output(request_id: str, num_prompt_tokens: int, num_output_tokens: int = 0,
                 first_scheduled_time: float | None = None) -> RequestOutput:
    """The last output of a request the engine ended because something failed while serving it."""
    return RequestOutput(request_id, [], "", num_prompt_tokens, num_output_tokens, finished=True,
                         finish_reason="error", first_scheduled_time=first_scheduled_time,
                         error=failure_message(request_id), error_code="engine_error")


class StepIsolation:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.failing_steps = 0  # consecutive steps whose computed requests all failed alone

    def execute(self, out: SchedulerOutput, grammar: GrammarOutput | None) -> tuple[RunnerOutput, list[str]]:
        """The runner's step; returns its output for the requests that ran, and the requests pinned with a failure
        (logged; each to be ended with an error). Raises what cannot be pinned."""
        failed = self.runner.update_batch(out)
        scheduled, drafts = out.num_scheduled_tokens, out.spec_token_ids
        if failed:
            for request_id, exc in failed.items():
                log_failure(request_id, "setting its row of the batch", exc)
            scheduled = {rid: n for rid, n in scheduled.items() if rid not in failed}
            drafts = {rid: d for rid, d in drafts.items() if rid not in failed}
        bitmasks = grammar.bitmasks if grammar is not None else {}
        try:
            result = self.runner.compute(scheduled, drafts, bitmasks)
        except Exception as exc:  # noqa: BLE001 - pinned on a request by bisection, or raised again
            result, alone = self._bisect(scheduled, drafts, bitmasks, exc)
            return result, [*failed, *alone]
        if scheduled:
            self.failing_steps = 0
        return result, list(failed)

    def _bisect(self, scheduled: dict[str, int], drafts: dict[str, list[int]], bitmasks: dict,
                exc: Exception) -> tuple[RunnerOutput, list[str]]:
        """Compute the step's requests again in halves, recursively, after ``compute`` of all raised ``exc``."""
        result, alone = RunnerOutput(), {}

        def split(part: list[str], error: Exception) -> None:
            if len(part) == 1:
                alone[part[0]] = error
                return
            for half in (part[:len(part) // 2], part[len(part) // 2:]):
                try:
                    merge(result, self.runner.compute({rid: scheduled[rid] for rid in half},
                                                      {rid: drafts[rid] for rid in half if rid in drafts}, bitmasks))
                except Exception as half_exc:  # noqa: BLE001 - split again
                    split(half, half_exc)
        split(list(scheduled), exc)
        if len(alone) == len(scheduled):
            self.failing_steps += 1
            if len(scheduled) > 1 or self.failing_steps >= MAX_FAILING_STEPS:
                raise exc  # no request's fault: the engine's
        else:
            self.failing_steps = 0
        for request_id, error in alone.items():
            log_failure(request_id, "computing its step", error)
        return result, list(alone)


def merge(into: RunnerOutput, part: RunnerOutput) -> None:
    """Add a subset's output to the step's (every field of RunnerOutput is a dict keyed by request id)."""
    for f in dataclasses.fields(RunnerOutput):
        getattr(into, f.name).update(getattr(part, f.name))
