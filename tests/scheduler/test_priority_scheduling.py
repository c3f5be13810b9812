"""Interactive work first, batch work on the capacity it leaves (scheduler/priority.py), with the fake runner: the
outputs stay exact whatever the order, and every step passes the integrity check."""

import random

from tests.scheduler.fake_runner import drain, expected_output, make_request, random_workload, run_step
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.scheduler.priority import BATCH, INTERACTIVE
from tokenmill.scheduler.scheduler import Scheduler


def request(rid, prompt_len, max_tokens, priority, seed=0):
    r = make_request(rid, prompt_len, max_tokens, seed=seed)
    r.priority = priority
    return r


def test_an_interactive_prefill_runs_alone_while_batch_decodes_sit_it_out():
    sched = Scheduler(KVCacheManager(num_blocks=256, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    batch = [request(f"b{i}", 8, 30, BATCH, seed=i) for i in range(4)]
    for r in batch:
        sched.add_request(r)
    run_step(sched)  # the batch prompts
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {r.request_id for r in batch}  # batch decodes while nothing else waits
    chat = request("i", 20, 5, INTERACTIVE, seed=9)
    sched.add_request(chat)
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"i": 20} and not out.preempted_ids  # alone; the batch keeps its blocks
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"i", *(r.request_id for r in batch)}  # decodes run side by side
    assert list(out.num_scheduled_tokens)[0] == "i"  # and the interactive one gets the budget first
    drain(sched)
    assert all(r.output_token_ids == expected_output(r) for r in [*batch, chat])


def test_a_long_interactive_prompt_holds_batch_off_for_every_chunk():
    sched = Scheduler(KVCacheManager(num_blocks=256, block_size=4), max_num_seqs=8, max_num_batched_tokens=16)
    b = request("b", 4, 40, BATCH)
    sched.add_request(b)
    run_step(sched)
    sched.add_request(request("i", 40, 3, INTERACTIVE, seed=3))
    steps = [run_step(sched)[0].num_scheduled_tokens for _ in range(3)]
    assert steps == [{"i": 16}, {"i": 16}, {"i": 8}]
    assert set(run_step(sched)[0].num_scheduled_tokens) == {"i", "b"}


def arrives_after(sched, batch, chat):
    """Admit ``batch`` in one step, then ``chat`` arrives: the output of the step after."""
    for r in batch:
        sched.add_request(r)
    run_step(sched)
    sched.add_request(chat)
    return run_step(sched)[0]


def test_interactive_requests_take_batch_seats_and_blocks_and_batch_is_preempted_first():
    # Two seats, both held by batch work: an interactive request takes the newest one's seat.
    sched = Scheduler(KVCacheManager(num_blocks=256, block_size=4), max_num_seqs=2, max_num_batched_tokens=64)
    out = arrives_after(sched, [request("b1", 8, 20, BATCH, seed=1), request("b2", 8, 20, BATCH, seed=2)],
                        request("i1", 8, 4, INTERACTIVE, seed=3))
    assert out.preempted_ids == ["b2"] and out.num_scheduled_tokens == {"i1": 8}
    assert [r.request_id for r in sched.waiting] == ["b2"]
    drain(sched)
    # KV blocks: 12 blocks of 4 held by two batch requests; the interactive one takes a batch request's blocks.
    sched = Scheduler(KVCacheManager(num_blocks=12, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    batch = [request(f"b{i}", 20, 4, BATCH, seed=i) for i in range(2)]
    chat = request("i", 16, 4, INTERACTIVE, seed=5)
    out = arrives_after(sched, batch, chat)
    assert out.preempted_ids == ["b1"] and out.num_scheduled_tokens == {"i": 16}
    drain(sched)
    assert all(r.output_token_ids == expected_output(r) for r in [*batch, chat])


def test_an_interactive_request_never_preempts_its_own_priority_and_waiting_keeps_priority_order():
    sched = Scheduler(KVCacheManager(num_blocks=256, block_size=4), max_num_seqs=1, max_num_batched_tokens=64)
    sched.add_request(request("i1", 8, 6, INTERACTIVE, seed=1))
    run_step(sched)
    for rid, priority in (("b", BATCH), ("i2", INTERACTIVE), ("i3", INTERACTIVE)):
        sched.add_request(request(rid, 8, 3, priority))
    out, _ = run_step(sched)
    assert not out.preempted_ids and list(out.num_scheduled_tokens) == ["i1"]
    assert [r.request_id for r in sched.waiting] == ["i2", "i3", "b"]
    finished = [r.request_id for o in drain(sched) for r in o.new_requests]
    assert finished == ["i2", "i3", "b"]


def test_random_mixed_priorities_stay_exact():
    rng = random.Random(7)
    sched = Scheduler(KVCacheManager(num_blocks=40, block_size=4), max_num_seqs=6, max_num_batched_tokens=24)
    original = sched.add_request

    def add(r):
        r.priority = rng.choice((INTERACTIVE, BATCH))
        original(r)
    sched.add_request = add
    reqs = random_workload(sched, rng, prefixes=[[], [3, 4, 5, 6, 7, 8, 9, 10]], max_prompt=30, max_new=20)
    assert sched.num_preemptions_total > 0
    assert all(r.output_token_ids == expected_output(r) for r in reqs if r.status.value != "abort")
