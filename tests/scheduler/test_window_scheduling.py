"""Sliding-window KV groups through the scheduler: each group keeps its own block table, a window group returns the
blocks behind its window while the request runs, and prefix hits need the window's blocks. The fake runner reads
each group's table (a window group only the positions its window sees), so a block freed too early, reused by
another request, or a hit with the wrong contents changes the outputs; a read of a freed entry fails outright."""

import random

import pytest

from tests.scheduler.fake_runner import VOCAB, drain, expected_output, make_request, random_workload, run_step
from tokenmill.kvcache.groups import KVGroups
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.scheduler.request import RequestStatus
from tokenmill.scheduler.scheduler import Scheduler

BS = 4


def scheduler(windows: tuple[int, ...], num_blocks: int, budget: int = 16, max_num_seqs: int = 6,
              caching: bool = True) -> Scheduler:
    groups = KVGroups(windows, tuple((i,) for i in range(len(windows))), 1)
    return Scheduler(KVCacheManager(num_blocks, BS, caching, groups), max_num_seqs, budget)


def test_a_window_group_holds_only_its_window_while_the_full_group_grows():
    sched = scheduler((0, 6), num_blocks=64, budget=64)
    r = make_request("r", 30, 20, seed=1)
    sched.add_request(r)
    held = []  # after each step: live blocks of the full and of the window group, computed tokens
    while sched.has_unfinished():
        run_step(sched)
        if r.block_tables:
            full, window = ([b for b in table if b != sched.kv.null_block] for table in r.block_tables)
            held.append((len(full), len(window), r.num_computed_tokens))
    assert r.output_token_ids == expected_output(r, (0, 6))
    # The full group holds every computed token; the window group (from the 30-token prefill on) only the blocks
    # of the last 6 - 1 keys and the next query: at most 3 blocks of 4.
    assert all(full >= -(-computed // BS) for full, _, computed in held)
    assert max(window for _, window, _ in held) <= 3 < 12 <= held[-1][0]
    assert sched.kv.pool.num_free_blocks == 64


@pytest.mark.parametrize("windows", [(0, 5), (0, 4, 9), (7,), (3, 0, 3)])
def test_random_workload_with_windows_prefix_hits_drafts_aborts_and_preemptions(windows):
    rng = random.Random(sum(windows))
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(4)]
    num_blocks = 13 * len(windows)  # tight: requests get preempted
    sched = scheduler(windows, num_blocks=num_blocks, budget=14)

    def propose(request, tokens):  # drafts from the true continuation, a third of them wrong
        done = len(tokens) - request.num_prompt_tokens
        truth = expected_output(request, windows)[done:done + 3]
        return [(t + 1) % VOCAB if rng.random() < 0.3 else t for t in truth]

    reqs = random_workload(sched, rng, prefixes, max_prompt=14, max_new=24, steps=500, admit_steps=180,
                           propose=propose)
    for r in reqs:
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == expected_output(r, windows), r.request_id
    assert sched.kv.pool.num_free_blocks == num_blocks
    assert sched.num_preemptions_total > 0 and sched.kv.prefix_hits_total > 0


def _after_one_request(seed: int) -> tuple[Scheduler, list[int], object]:
    """A scheduler with full and window-6 groups after one request with a 26-token prefix ran to its end."""
    sched = scheduler((0, 6), num_blocks=64, budget=64)
    prefix = [random.Random(seed).randrange(1, VOCAB) for _ in range(26)]
    a = make_request("a", 4, 3, seed=1, prefix=prefix)
    sched.add_request(a)
    drain(sched)
    return sched, prefix, a


def test_a_prefix_hit_needs_the_window_blocks_and_revives_them():
    sched, prefix, _ = _after_one_request(5)
    b = make_request("b", 4, 3, seed=2, prefix=prefix)
    sched.add_request(b)
    out, _ = run_step(sched)
    # 6 blocks of the 26 shared tokens: the full group holds them all, the window group the ones the window of
    # position 24 reaches (keys 19.. in blocks 4 and 5); blocks 0..3 are null, freed by a long ago.
    full, window = out.new_requests[0].block_tables
    assert out.new_requests[0].num_computed_tokens == 24 and len(full) >= 6
    assert window[:4] == [sched.kv.null_block] * 4 and sched.kv.null_block not in window[4:]
    drain(sched)
    assert b.output_token_ids == expected_output(b, (0, 6)) and b.num_cached_tokens == 24


def test_a_hit_shrinks_to_what_the_window_group_still_caches():
    sched, prefix, a = _after_one_request(6)
    kv = sched.kv
    hashes = a.block_hashes
    # Evict the window group's cached block 5 (as the pool would under pressure): a hit of 6 blocks now lacks the
    # window's keys, so the hit falls back to the longest run whose window blocks are all cached.
    block5 = kv.pool.lookup(kv._key(hashes[5], 1), a.all_token_ids[20:24])
    assert block5 is not None
    kv.pool._free.move_to_end(block5, last=False)
    kv.pool.allocate(1)
    kv.pool.free([block5])
    b = make_request("b", 4, 3, seed=2, prefix=prefix)
    hits = kv.find_cached_prefix(b)
    assert len(hits[0]) == 5  # position 20's window (keys 15..) lies in blocks 3 and 4: both still cached
    sched.add_request(b)
    drain(sched)
    assert b.output_token_ids == expected_output(b, (0, 6))


def test_groups_pad_little_and_bound_a_long_request():
    gemma = KVGroups.for_layers([0 if (i + 1) % 6 == 0 else 1024 for i in range(62)])  # Gemma-3-27B's pattern
    assert sorted(set(gemma.windows)) == [0, 1024] and gemma.num_layers == 62
    assert sorted(layer for ls in gemma.layers for layer in ls) == list(range(62))
    slots = gemma.group_size * gemma.num_groups
    assert slots <= 62 * 1.1  # padding: at most 10% of the layers
    oss = KVGroups.for_layers([128 if i % 2 == 0 else 0 for i in range(24)])
    assert (oss.num_groups, oss.group_size) == (2, 12)
    assert KVGroups.for_layers([0] * 5) == KVGroups.single(5)
    # 8k tokens: the full groups hold 512 blocks of 16, each window group the 1024 - 1 keys behind and the query.
    full = sum(1 for w in gemma.windows if not w)
    assert gemma.blocks_for(8192, 16) == full * 512 + (gemma.num_groups - full) * 64
    assert gemma.max_tokens_for(gemma.blocks_for(8192, 16), 16, limit=1 << 20) >= 8192
    assert KVGroups((64,), ((0,),), 1).max_tokens_for(5, 16, limit=1 << 20) == 1 << 20  # a window only: unbounded
