"""``Scheduler.update_from_output``, the one place a request changes after a step: each stop kind alone and meeting
another in the same step (a step keeps several tokens when drafts are accepted), late grammar findings, errors,
drafts for the next step, and requests passed over while their grammar is prepared."""

import pytest

from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler.output import OutputReports, RunnerOutput, Stop
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.scheduler.scheduler import Scheduler

EOS, STOP_ID = 5, 6
PROMPT = [10, 11, 12, 13]


def started(max_tokens=10, **params) -> tuple[Scheduler, Request]:
    """A request whose prompt ran (first token 20 sampled) and whose next step verifies drafts 21, 22, 23."""
    sched = Scheduler(KVCacheManager(32, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP_ID], **params),
                      max_tokens=max_tokens, eos_token_ids=(EOS,))
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput({"r": [20]}), OutputReports(), now=1.0)
    assert request.output_token_ids == [20] and request.first_token_time == 1.0
    request.spec_token_ids = [21, 22, 23]
    return sched, request


def step(sched: Scheduler, sampled: list[int], reports: OutputReports | None = None):
    """One decode step that verified the drafts and kept ``sampled`` (accepted drafts, then the model's token)."""
    out = sched.schedule()
    assert out.spec_token_ids == {"r": [21, 22, 23]}
    updates = sched.update_from_output(out, RunnerOutput({"r": sampled}, drafts={"r": [30, 31]}),
                                       reports or OutputReports(), now=2.0)
    sched.check_integrity()
    return updates


def test_all_drafts_kept_without_a_stop_and_the_next_drafts_set():
    sched, r = started()
    [update] = step(sched, [21, 22, 23, 24])
    assert update.new_token_ids == [21, 22, 23, 24] and r.status == RequestStatus.RUNNING
    assert r.num_computed_tokens == len(PROMPT) + 4 and r.spec_token_ids == [30, 31]
    assert r.first_token_time == 1.0  # set once, at the first token


@pytest.mark.parametrize("sampled,kept,status,reason", [
    ([21, EOS, 23, 24], [21, EOS], RequestStatus.FINISHED_STOPPED, None),  # EOS among accepted drafts
    ([21, 22, STOP_ID, 24], [21, 22, STOP_ID], RequestStatus.FINISHED_STOPPED, STOP_ID),
])
def test_token_stops_cut_the_step_and_drop_the_kv_after_them(sampled, kept, status, reason):
    sched, r = started()
    [update] = step(sched, sampled)
    assert update.new_token_ids == kept and r.output_token_ids == [20] + kept
    assert (r.status, r.stop_reason) == (status, reason)
    assert not r.block_tables and sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks  # finished: freed


def test_max_tokens_cuts_the_drafts_then_the_step_ends_at_length():
    sched, r = started(max_tokens=3)
    out = sched.schedule()
    assert out.spec_token_ids == {"r": [21]}  # one draft fits before max_tokens 3
    [update] = sched.update_from_output(out, RunnerOutput({"r": [21, 22]}), OutputReports())
    assert update.new_token_ids == [21, 22] and r.status == RequestStatus.FINISHED_LENGTH


def test_a_stop_string_before_a_token_stop_wins_and_truncates():
    sched, r = started()
    [update] = step(sched, [21, 22, EOS, 24], OutputReports(stops={"r": Stop(0, "xy")}))
    assert update.new_token_ids == [21] and r.output_token_ids == [20, 21]
    assert (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, "xy")


def test_a_stop_string_at_the_token_stops_own_token_gives_its_reason():
    sched, r = started()
    [update] = step(sched, [21, STOP_ID, 23, 24], OutputReports(stops={"r": Stop(1, "xy")}))
    assert update.new_token_ids == [21, STOP_ID]
    assert (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, "xy")


def test_a_stop_string_at_max_tokens_is_a_stop_not_a_length():
    sched, r = started(max_tokens=4)
    out = sched.schedule()
    assert out.spec_token_ids == {"r": [21, 22]}
    sched.update_from_output(out, RunnerOutput({"r": [21, 22, 23]}), OutputReports(stops={"r": Stop(2, "ab")}))
    assert r.output_token_ids == [20, 21, 22, 23]
    assert (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, "ab")


def test_a_grammar_completion_before_a_token_stop_ends_the_output_there():
    sched, r = started(ignore_eos=True)
    [update] = step(sched, [21, EOS, 23, 24], OutputReports(stops={"r": Stop(1)}))
    assert update.new_token_ids == [21, EOS]  # ignore_eos: EOS is the grammar's stop token, nothing after it
    assert (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)


def test_a_grammar_completion_at_a_stop_tokens_own_token_keeps_the_token_stop():
    sched, r = started()
    step(sched, [21, STOP_ID, 23, 24], OutputReports(stops={"r": Stop(1)}))
    assert (r.status, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, STOP_ID)


def test_a_grammar_completion_at_max_tokens_is_a_length():
    sched, r = started(max_tokens=4)
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput({"r": [21, 22, 23]}), OutputReports(stops={"r": Stop(2)}))
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [20, 21, 22, 23]


def test_eos_before_min_tokens_is_no_stop():
    sched, r = started(min_tokens=4)
    [update] = step(sched, [21, EOS, 23, 24])  # outputs 2..5: EOS is the 3rd output, min_tokens 4
    assert update.new_token_ids == [21, EOS, 23, 24] and r.status == RequestStatus.RUNNING


def test_kept_tokens_are_what_the_token_stops_leave_without_changing_the_request():
    sched, r = started()
    kept = sched.kept_tokens(RunnerOutput({"r": [21, STOP_ID, 23]}))
    assert (kept["r"].token_ids, kept["r"].finishing) == ([21, STOP_ID], True)
    assert sched.kept_tokens(RunnerOutput({"r": [21, 22]}))["r"].finishing is False
    assert r.output_token_ids == [20] and r.status == RequestStatus.RUNNING


def test_a_grammars_drafts_replace_the_proposers():
    sched, r = started()
    step(sched, [21, 22, 23, 24], OutputReports(drafts={"r": [30]}))
    assert r.spec_token_ids == [30]
    sched2, r2 = started()
    step(sched2, [21, 22, 23, 24], OutputReports(drafts={"r": []}))  # its grammar is late: no drafts
    assert r2.spec_token_ids == []


def test_late_completion_and_errors_finish_requests_that_were_not_scheduled():
    sched, r = started()
    other = Request("o", [1, 2], SamplingParams(max_tokens=5), max_tokens=5)
    sched.add_request(other)
    out = sched.schedule(blocked={"r"})  # r's grammar is busy: passed over, keeping its blocks
    assert "r" not in out.num_scheduled_tokens and r.block_tables and "o" in out.num_scheduled_tokens
    updates = sched.update_from_output(out, RunnerOutput({"o": [3]}), OutputReports(completed={"r"}))
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("o", [3]), ("r", [])]
    assert r.status == RequestStatus.FINISHED_STOPPED and not r.block_tables
    out = sched.schedule()
    updates = sched.update_from_output(out, RunnerOutput({"o": [4]}), OutputReports(errors={"o": "too slow"}))
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("o", [])]  # one output, nothing kept
    assert other.output_token_ids == [3] and other.status == RequestStatus.FINISHED_ERROR and other.error == "too slow"
    assert other.status.finish_reason == "error" and not sched.has_unfinished()
    sched.check_integrity()
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


def test_a_blocked_waiting_request_keeps_its_place_and_others_pass():
    sched = Scheduler(KVCacheManager(32, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    first, second = (Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), max_tokens=2) for rid in "ab")
    sched.add_request(first)
    sched.add_request(second)
    out = sched.schedule(blocked={"a"})
    assert list(out.num_scheduled_tokens) == ["b"] and list(sched.waiting) == [first]
    sched.update_from_output(out, RunnerOutput({"b": [4]}), OutputReports())
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("b", 1), ("a", 3)]
