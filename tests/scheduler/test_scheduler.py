"""Scheduler policy with a fake runner: budget, chunking, preemption, abort, integrity after every step."""

import random

import pytest

from tests.scheduler.fake_runner import drain, expected_output, make_request, run_step, run_step_sampled
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler.request import RequestStatus
from tokenmill.scheduler.scheduler import Scheduler

def test_chunked_prefill_respects_budget_and_finishes():
    sched = Scheduler(KVCacheManager(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=16)
    req = make_request("a", prompt_len=40, max_tokens=5)
    sched.add_request(req)
    out, sampled = run_step_sampled(sched)
    assert (out.new_requests[0].num_computed_tokens, out.num_scheduled_tokens, sampled) == (0, {"a": 16}, {})
    out, sampled = run_step_sampled(sched)
    assert (out.running[0].num_computed_tokens, out.num_scheduled_tokens, sampled) == (16, {"a": 16}, {})
    out, sampled = run_step_sampled(sched)
    assert (out.running[0].num_computed_tokens, out.num_scheduled_tokens) == (32, {"a": 8}) and "a" in sampled
    drain(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == expected_output(req)
    assert sched.kv.pool.num_free_blocks == 64


def test_running_requests_go_first_then_waiting_fill_budget():
    sched = Scheduler(KVCacheManager(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_request("a", 8, 4, seed=1), make_request("b", 8, 4, seed=2)
    sched.add_request(a)
    run_step(sched)  # a: 8 prompt tokens
    sched.add_request(b)
    out, _ = run_step(sched)
    # a decodes one token first, then b's prefill takes the remaining 9 of the budget -> chunk of 8.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 8)]


def test_max_num_seqs_bounds_running():
    sched = Scheduler(KVCacheManager(num_blocks=256, block_size=4), max_num_seqs=3, max_num_batched_tokens=1000)
    reqs = [make_request(str(i), 5, 6, seed=i) for i in range(7)]
    for r in reqs:
        sched.add_request(r)
    out, _ = run_step(sched)
    assert len(out.num_scheduled_tokens) == 3
    drain(sched)
    assert all(r.output_token_ids == expected_output(r) for r in reqs)


def test_preemption_recomputes_and_gives_identical_outputs():
    # 12 blocks of 4 tokens = 48 token slots; six requests of 10 + 12 tokens need 132.
    sched = Scheduler(KVCacheManager(num_blocks=12, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [make_request(str(i), 10, 12, seed=i) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    outs = drain(sched)
    assert sum(len(o.preempted_ids) for o in outs) >= 1
    assert sched.num_preemptions_total >= 1
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r)
    assert sched.kv.pool.num_free_blocks == 12


def test_preempted_request_returns_to_front_of_waiting():
    sched = Scheduler(KVCacheManager(num_blocks=4, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = make_request("a", 7, 20, 1), make_request("b", 7, 20, 2), make_request("c", 4, 2, 3)
    for r in (a, b):
        sched.add_request(r)
    run_step(sched)  # a and b take 2 blocks each: pool full
    sched.add_request(c)
    for _ in range(3):
        out, _ = run_step(sched)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ["b"]
    assert list(sched.waiting)[:2] == [b, c]
    assert b.num_computed_tokens == 0 and b.block_tables == []


@pytest.mark.parametrize("where", ["waiting", "running", "mid_prefill"])
def test_abort_anywhere_frees_blocks(where):
    sched = Scheduler(KVCacheManager(num_blocks=32, block_size=4), max_num_seqs=8, max_num_batched_tokens=8)
    keep, victim = make_request("keep", 3, 5, 1), make_request("victim", 20, 5, 2)
    sched.add_request(keep)
    sched.add_request(victim)
    if where != "waiting":
        run_step(sched)  # victim gets a 5-token chunk of its 20-token prompt
        if where == "running":
            while victim.num_computed_tokens < victim.num_prompt_tokens:
                run_step(sched)
    assert sched.abort("victim") is victim
    assert victim.status == RequestStatus.FINISHED_ABORTED and victim.block_tables == []
    sched.kv.pool.check_integrity()
    assert sched.abort("victim") is None  # idempotent
    drain(sched)
    assert keep.output_token_ids == expected_output(keep)
    assert sched.kv.pool.num_free_blocks == 32


def test_random_workload_integrity_and_outputs():
    rng = random.Random(0)
    sched = Scheduler(KVCacheManager(num_blocks=20, block_size=4), max_num_seqs=5, max_num_batched_tokens=12)
    reqs, aborted = [], set()
    for step in range(400):
        if step < 120 and rng.random() < 0.3:
            r = make_request(f"r{step}", rng.randrange(1, 30), rng.randrange(1, 20), seed=step)
            reqs.append(r)
            sched.add_request(r)
        if reqs and rng.random() < 0.03:
            victim = rng.choice(reqs)
            if sched.abort(victim.request_id):
                aborted.add(victim.request_id)
        if sched.has_unfinished():
            run_step(sched)
    drain(sched)
    for r in reqs:
        if r.request_id not in aborted:
            assert r.output_token_ids == expected_output(r), r.request_id
    assert sched.kv.pool.num_free_blocks == 20


def test_output_is_plain_data_the_runner_can_copy():
    """No Request object (the scheduler's mutable state) crosses to the runner: every field is ids, ints, lists,
    dicts or the request's SamplingParams, and a deep copy of it equals it."""
    import copy
    import dataclasses

    sched = Scheduler(KVCacheManager(num_blocks=12, block_size=4), max_num_seqs=8, max_num_batched_tokens=16)
    for r in [make_request(str(i), 10, 12, seed=i) for i in range(6)]:
        sched.add_request(r)

    def plain(value) -> bool:
        if isinstance(value, (str, int, float, bool, type(None), SamplingParams)):
            return True
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        if isinstance(value, dict):
            return all(plain(k) and plain(v) for k, v in value.items())
        if dataclasses.is_dataclass(value):
            return all(plain(getattr(value, f.name)) for f in dataclasses.fields(value))
        return False

    for out in drain(sched):
        assert plain(out) and copy.deepcopy(out) == out
