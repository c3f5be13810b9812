"""Speculative decoding through the scheduler, with the fake runner verifying drafts against its fake model over the
KV it reads back: a wrong rollback of rejected drafts leaves their tokens in the cache and changes later outputs."""

import random

from tests.scheduler.fake_runner import VOCAB, drain, expected_output, make_request, random_workload, run_step
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.scheduler.request import RequestStatus
from tokenmill.scheduler.scheduler import Scheduler


def scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size=4), max_num_seqs, budget)


def oracle(k: int, rng: random.Random | None = None, wrong: float = 0.0):
    """Drafts from the true continuation; with probability ``wrong`` per draft, a wrong token at that position."""
    def propose(request, tokens):
        done = len(tokens) - request.num_prompt_tokens  # outputs after this step's tokens
        truth = expected_output(request)[done:done + k]
        return [(t + 1) % VOCAB if rng and rng.random() < wrong else t for t in truth]
    return propose


def test_right_drafts_are_all_accepted_and_save_steps():
    plain, spec = scheduler(), scheduler()
    a, b = make_request("a", 6, 20, seed=1), make_request("a", 6, 20, seed=1)
    plain.add_request(a)
    spec.add_request(b)
    steps_plain, steps_spec = len(drain(plain)), len(drain(spec, propose=oracle(3)))
    assert a.output_token_ids == b.output_token_ids == expected_output(a)
    assert len(b.output_token_ids) == 20 and b.status == RequestStatus.FINISHED_LENGTH  # never past max_tokens
    assert steps_spec < steps_plain / 3
    assert spec.spec.num_accepted_tokens_total == spec.spec.num_draft_tokens_total > 0


def test_wrong_drafts_are_rejected_and_their_blocks_released():
    sched = scheduler()
    r = make_request("r", 3, 12, seed=2)
    sched.add_request(r)
    run_step(sched)  # the prompt: 3 tokens, the first output
    drafts = [(t + 1) % VOCAB for t in expected_output(r)[1:9]]  # 8 wrong drafts
    r.spec_token_ids = list(drafts)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"r": 9} and out.spec_token_ids == {"r": drafts}
    assert len(out.running[0].new_block_ids[0]) == 2  # positions 3..11 take blocks 1 and 2
    assert r.num_computed_tokens == 4 and r.num_output_tokens == 2  # only the model's own token was kept
    assert len(r.block_tables[0]) == 2  # block 2 held only rejected drafts: it went back
    assert sched.spec.num_draft_tokens_total == 8 and sched.spec.num_accepted_tokens_total == 0
    drain(sched)
    assert r.output_token_ids == expected_output(r)


def test_acceptance_is_counted_by_draft_position():
    sched = scheduler()
    r = make_request("r", 3, 12, seed=2)
    sched.add_request(r)
    run_step(sched)
    truth = expected_output(r)
    r.spec_token_ids = [truth[1], truth[2], (truth[3] + 1) % VOCAB]  # two right, then a wrong one
    run_step(sched)
    assert r.output_token_ids == truth[:4]  # 2 accepted drafts + the model's correction
    assert sched.spec.accepted_by_position == [1, 1, 0] and sched.spec.drafted_by_position == [1, 1, 1]


def test_random_workload_with_drafts_aborts_preemptions_and_shared_prefixes():
    rng = random.Random(11)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    sched = scheduler(num_blocks=14, budget=14, max_num_seqs=6)
    propose = oracle(4, rng, wrong=0.3)
    reqs = random_workload(sched, rng, prefixes, max_prompt=12, max_new=16, propose=propose)
    for r in reqs:
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == expected_output(r), r.request_id
            assert len(r.output_token_ids) == r.max_tokens
    assert sched.kv.pool.num_free_blocks == 14
    assert sched.num_preemptions_total > 0 and sched.kv.prefix_hits_total > 0
    assert 0 < sched.spec.num_accepted_tokens_total < sched.spec.num_draft_tokens_total


def test_drafts_that_do_not_fit_are_dropped_not_paid_for_with_a_preemption():
    sched = scheduler(num_blocks=4)
    a, b = make_request("a", 7, 10, seed=1), make_request("b", 7, 10, seed=2)
    for r in (a, b):
        sched.add_request(r)
    run_step(sched)  # 7 prompt tokens + 1 output each: 2 blocks each, the pool is full
    a.spec_token_ids = expected_output(a)[1:4]  # right drafts, but positions 8..10 need a third block
    out, _ = run_step(sched)
    assert out.preempted_ids == [] and out.spec_token_ids == {} and out.num_scheduled_tokens == {"a": 1, "b": 1}
    drain(sched)
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)


def test_lookahead_slots_come_from_free_blocks_and_reach_the_runner():
    """A drafter inside the model (MTP) writes num_lookahead_tokens slots past a sampling request's scheduled tokens:
    they are allocated when blocks are free (and sent in the diff: the fake runner checks its block table equals the
    request's), never when only a preemption would free them."""
    sched = Scheduler(KVCacheManager(6, block_size=4), max_num_seqs=8, max_num_batched_tokens=64,
                      num_lookahead_tokens=3)
    a = make_request("a", 8, 6, seed=1)
    sched.add_request(a)
    out, _ = run_step(sched)  # 8 prompt tokens sample: slots to 8 + 3 -> 3 blocks
    assert out.new_requests[0].block_tables == a.block_tables and len(a.block_tables[0]) == 3
    b = make_request("b", 11, 6, seed=2)
    sched.add_request(b)
    out, _ = run_step(sched)  # a decodes (still 3 blocks); b's 11 tokens take 3 blocks, the pool's last
    assert (len(a.block_tables[0]), len(b.block_tables[0]), sched.kv.pool.num_free_blocks) == (3, 3, 0)
    out, _ = run_step(sched)  # b's first decode (position 11) needs no block; a's lookahead (9..12) finds none
    assert out.preempted_ids == [] and len(a.block_tables[0]) == 3
    drain(sched)
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)


def test_random_workload_with_lookahead_and_drafts_keeps_integrity():
    rng = random.Random(3)
    sched = Scheduler(KVCacheManager(10, block_size=4), max_num_seqs=6, max_num_batched_tokens=14,
                      num_lookahead_tokens=2)
    propose = oracle(3, rng, wrong=0.4)
    reqs = []
    for step in range(400):
        if step < 150 and rng.random() < 0.35:
            reqs.append(make_request(f"r{step}", rng.randrange(1, 16), rng.randrange(1, 20), seed=step))
            sched.add_request(reqs[-1])
        if reqs and rng.random() < 0.03:
            sched.abort(rng.choice(reqs).request_id)
        if sched.has_unfinished():
            run_step(sched, propose=propose)  # checks integrity after every step
    drain(sched, propose=propose)
    assert all(r.output_token_ids == expected_output(r) for r in reqs if r.status != RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_free_blocks == 10 and sched.num_preemptions_total > 0
