"""Prefix caching through the scheduler, with the fake runner that samples from its fake KV cache: a hit with the
wrong contents, or a write into a shared block, changes outputs or fails an assertion."""

import random

import pytest

from tests.scheduler.fake_runner import VOCAB, drain, expected_output, make_request, run_step
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.scheduler.request import RequestStatus
from tokenmill.scheduler.scheduler import Scheduler

SYSTEM = [random.Random(7).randrange(1, VOCAB) for _ in range(22)]  # 5 full blocks of 4, and 2 tokens


def scheduler(num_blocks: int = 64, budget: int = 64, caching: bool = True, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=caching), max_num_seqs, budget)


def test_second_request_reuses_the_shared_prefix_and_gets_the_same_tokens():
    sched = scheduler()
    a = make_request("a", 5, 6, seed=1, prefix=SYSTEM)
    sched.add_request(a)
    drain(sched)
    b = make_request("b", 7, 6, seed=2, prefix=SYSTEM)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert out.new_requests[0].num_computed_tokens == 20  # 5 whole blocks of the 22 shared tokens
    assert out.num_scheduled_tokens == {"b": b.num_prompt_tokens - 20}
    drain(sched)
    assert b.output_token_ids == expected_output(b) and b.num_cached_tokens == 20 and a.num_cached_tokens == 0
    assert (sched.kv.prefix_queries_total, sched.kv.prefix_hits_total) == (a.num_prompt_tokens + b.num_prompt_tokens,
                                                                           20)


def test_an_identical_block_aligned_prompt_still_computes_its_last_block():
    sched = scheduler()
    a = make_request("a", 2, 4, seed=1, prefix=SYSTEM)  # 24 tokens: 6 full blocks
    b = make_request("b", 2, 4, seed=1, prefix=SYSTEM)
    sched.add_request(a)
    drain(sched)
    sched.add_request(b)
    out, _ = run_step(sched)
    assert out.new_requests[0].num_computed_tokens == 20 and out.num_scheduled_tokens == {"b": 4}
    drain(sched)
    assert b.output_token_ids == a.output_token_ids == expected_output(a)


def test_running_requests_share_blocks_while_both_run():
    sched = scheduler()
    a = make_request("a", 3, 12, seed=1, prefix=SYSTEM)
    sched.add_request(a)
    run_step(sched)  # a's prompt is computed: its 6 full blocks are cached
    b = make_request("b", 3, 12, seed=2, prefix=SYSTEM)
    sched.add_request(b)
    run_step(sched)
    assert b.block_tables[0][:5] == a.block_tables[0][:5]
    assert all(sched.kv.pool.blocks[i].ref_cnt == 2 for i in a.block_tables[0][:5])
    drain(sched)
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)
    assert sched.kv.pool.num_free_blocks == 64


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    sched = scheduler(num_blocks=12, budget=64)
    a, b = make_request("a", 13, 20, seed=1), make_request("b", 13, 20, seed=2)
    sched.add_request(a)
    sched.add_request(b)
    resumed = None
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out, _ = run_step(sched)
        resumed = resumed or next((n for n in out.new_requests if n.num_computed_tokens > 0), None)
    assert sched.num_preemptions_total >= 1 and resumed is not None
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)


def test_abort_of_a_sharer_keeps_the_other_correct():
    sched = scheduler()
    a, b = (make_request(r, 3, 10, seed=i, prefix=SYSTEM) for i, r in enumerate("ab"))
    sched.add_request(a)
    run_step(sched)
    sched.add_request(b)
    run_step(sched)
    sched.abort("a")
    sched.check_integrity()
    drain(sched)
    assert b.output_token_ids == expected_output(b) and b.status == RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("caching", [True, False])
def test_random_shared_prefix_workload_with_aborts_and_preemptions(caching):
    rng = random.Random(3)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(4)]
    sched = scheduler(num_blocks=24, budget=16, caching=caching, max_num_seqs=6)
    reqs = []
    for step in range(600):
        if step < 200 and rng.random() < 0.35:
            salt = rng.choice([None, None, "tenant"])
            r = make_request(f"r{step}", rng.randrange(1, 12), rng.randrange(1, 16), seed=step,
                             prefix=rng.choice(prefixes), cache_salt=salt)
            reqs.append(r)
            sched.add_request(r)
        if reqs and rng.random() < 0.03:
            sched.abort(rng.choice(reqs).request_id)
        if sched.has_unfinished():
            run_step(sched)  # checks the scheduler's integrity (reference counts included) after every step
    drain(sched)
    for r in reqs:
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == expected_output(r), r.request_id
    assert sched.kv.pool.num_free_blocks == 24
    assert sched.num_preemptions_total > 0
    hits = sched.kv.prefix_hits_total
    assert (hits > 0 and sched.kv.pool.num_evictions_total > 0) if caching else hits == 0
