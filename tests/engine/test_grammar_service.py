"""The engine's grammar service (engine/grammar.py) over scripted matchers: jobs on worker threads, what the step
loop waits for and what it does not, late findings, budgets, and requests whose ids come back. The real xgrammar
work is covered by tests/engine/test_structured_outputs.py and tests/structured/."""

import threading
import time

import numpy as np
import pytest

from tokenmill.engine.grammar import GrammarService
from tokenmill.engine.threads import DaemonPool
from tokenmill.scheduler.output import Kept, SchedulerOutput
from tokenmill.structured.spec import GrammarSpec

STOP = 99


class ScriptedMatchers:
    """GrammarMatchers' interface; a spec's value scripts its cost: "compile=S" sleeps S seconds to compile,
    "accept=S" sleeps S seconds per accepted token after the first three. Token STOP completes the output."""

    def __init__(self):
        self.live: dict[str, list[int]] = {}  # matcher key -> accepted tokens
        self.release = threading.Event()  # "compile=block" waits for it

    @staticmethod
    def _cost(spec: GrammarSpec, what: str) -> float:
        return next((float(part.split("=")[1]) for part in spec.value.split(",") if part.startswith(what + "=")
                     and part.split("=")[1] != "block"), 0.0)

    def add(self, key, spec, max_bytes=None, deadline=None):
        if "compile=block" in spec.value:
            self.release.wait(30)
        time.sleep(self._cost(spec, "compile"))
        self.live[key] = []
        self.live[key + "/spec"] = spec

    def accept(self, key, tokens):
        seen = self.live[key]
        if len(seen) >= 3:
            time.sleep(self._cost(self.live[key + "/spec"], "accept"))
        seen.extend(tokens)
        return tokens[-1] == STOP

    def valid_drafts(self, key, drafts):
        return [d for d in drafts if d != 7]  # the grammar refuses token 7

    def steer(self, key, tokens_left, outputs, deadline=None):
        return None

    def bitmask(self, key, drafts):
        return np.full((1 + len(drafts), 2), len(self.live[key]), dtype=np.int32)

    def remove(self, key):
        self.live.pop(key, None)
        self.live.pop(key + "/spec", None)


def service(timeout_s=5.0, max_workers=4) -> GrammarService:
    return GrammarService(ScriptedMatchers(), timeout_s, max_bytes=2**30, max_workers=max_workers)


def scheduled(*rids, drafts=None) -> SchedulerOutput:
    return SchedulerOutput(num_scheduled_tokens={r: 1 for r in rids}, spec_token_ids=drafts or {})


def until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_fast_grammar_is_applied_in_its_own_step():
    grammars = service()
    grammars.add("r", GrammarSpec("regex", ""), max_tokens=100)
    grammars.wait(1.0)
    assert "r" not in grammars.busy
    assert grammars.masks(scheduled("r")).bitmasks["r"].shape == (1, 2)
    found = grammars.advance({"r": Kept([1, 2], False)}, {"r": [3, 7, 4]}, grace_s=1.0)
    assert found.drafts == {"r": [3, 4]} and not found.complete_at and "r" not in grammars.busy
    assert grammars.masks(scheduled("r", drafts={"r": [3]})).bitmasks["r"].shape == (2, 2)  # a prefix of the rows
    found = grammars.advance({"r": Kept([5, STOP], False)}, {}, grace_s=1.0)
    assert found.complete_at == {"r": 1}


def test_a_slow_compile_keeps_only_its_request_busy():
    grammars = service()
    grammars.add("slow", GrammarSpec("regex", "compile=0.5"), max_tokens=100)
    grammars.add("fast", GrammarSpec("regex", ""), max_tokens=100)
    start = time.monotonic()
    grammars.wait(0.05)
    assert time.monotonic() - start < 0.4  # waited the grace, not the compile
    assert grammars.busy == {"slow"}
    until(lambda: (grammars.wait(0.01), "slow" not in grammars.busy)[1])


def test_a_completion_found_after_its_step_is_reported_late():
    """The job of step N finishes after the grace but before step N+1's first wait: its completion is not lost."""
    grammars = service()
    grammars.add("r", GrammarSpec("regex", "accept=0.3"), max_tokens=100)
    grammars.wait(1.0)
    grammars.advance({"r": Kept([1, 2, 3], False)}, {}, grace_s=1.0)
    found = grammars.advance({"r": Kept([4, STOP], False)}, {}, grace_s=0.01)  # slow now: not waited for
    assert not found.complete_at and found.drafts == {"r": []} and "r" in grammars.busy
    time.sleep(0.8)
    grammars.wait(0.01)  # the next step's first wait collects it
    assert "r" in grammars.busy  # complete, not yet reported: never scheduled again
    found = grammars.advance({}, {}, grace_s=0.01)
    assert found.completed == {"r"}


def test_a_job_over_its_budget_ends_its_request_and_frees_the_loop():
    grammars = service(timeout_s=0.2)
    grammars.add("r", GrammarSpec("regex", "accept=1.0"), max_tokens=100)
    grammars.wait(1.0)
    grammars.advance({"r": Kept([1, 2, 3], False)}, {}, grace_s=1.0)
    start = time.monotonic()
    grammars.advance({"r": Kept([4], False)}, {}, grace_s=0.01)
    until(lambda: (grammars.wait(0.01), "r" not in grammars._grammars)[1], seconds=5)
    assert time.monotonic() - start < 0.9  # ended at the budget, not when the call returned
    found = grammars.advance({}, {}, grace_s=0.01)
    assert "grammar_timeout" in found.errors["r"] and "r" not in grammars.busy


def test_a_stuck_thread_does_not_starve_the_others_and_queued_jobs_time_out():
    blocked = service(timeout_s=0.3, max_workers=1)  # one thread, taken by a job that never returns on its own
    blocked.add("stuck", GrammarSpec("regex", "compile=block"), max_tokens=100)
    blocked.add("queued", GrammarSpec("regex", ""), max_tokens=100)
    time.sleep(0.4)
    blocked.wait(0.01)
    found = blocked.advance({}, {}, grace_s=0.01)
    assert set(found.errors) == {"stuck", "queued"}  # the queued job timed out too: no request stays busy forever
    blocked.matchers.release.set()
    grown = service(max_workers=4)  # with room to grow, a new thread takes the next job
    grown.add("stuck", GrammarSpec("regex", "compile=block"), max_tokens=100)
    grown.add("next", GrammarSpec("regex", ""), max_tokens=100)
    until(lambda: (grown.wait(0.01), "next" not in grown.busy)[1], seconds=2)
    grown.matchers.release.set()


def test_a_request_id_used_again_gets_a_matcher_of_its_own():
    grammars = service()
    grammars.add("x", GrammarSpec("regex", "compile=0.3"), max_tokens=100)
    grammars.remove("x")  # aborted while compiling
    grammars.add("x", GrammarSpec("regex", ""), max_tokens=100)
    time.sleep(0.5)  # the first job finished, and dropped its own matcher only
    grammars.wait(0.01)
    assert "x" not in grammars.busy and grammars.masks(scheduled("x")).bitmasks["x"] is not None
    assert grammars.advance({"x": Kept([1], False)}, {}, grace_s=1.0).drafts == {"x": []}


def test_the_pool_grows_while_its_threads_are_busy():
    pool = DaemonPool(3, "test-pool")
    gate = threading.Event()
    jobs = [pool.submit(gate.wait, 10) for _ in range(2)]
    quick = pool.submit(lambda: 42)
    assert quick.result(timeout=2) == 42  # a third thread took it
    gate.set()
    assert all(j.result(timeout=2) for j in jobs)
    pool.close(2.0)


@pytest.mark.parametrize("grace", [0.0, 0.05])
def test_no_constrained_request_costs_nothing(grace):
    grammars = service()
    assert grammars.busy == set() and not grammars.pending
    assert grammars.advance({"a": Kept([1], False)}, {"a": [2]}, grace_s=grace).drafts == {}
