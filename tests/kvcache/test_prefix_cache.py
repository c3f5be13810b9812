"""Prefix caching in the pool and the manager: the hash chain, verified hits, sharing, salts and LRU eviction."""

import hashlib
from array import array

from tokenmill.kvcache.block_pool import BlockPool
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.kvcache.prefix import extend_block_hashes, hash_block
from tokenmill.scheduler.request import Request
from tokenmill.sampling.params import SamplingParams

BS = 4


def request(tokens: list[int], salt: str | None = None) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=1), max_tokens=1, cache_salt=salt)


def compute(kv: KVCacheManager, req: Request) -> None:
    """Admit ``req`` (taking prefix hits), 'compute' all its known tokens, and offer its full blocks to the cache."""
    hits = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - (len(hits[0]) if hits else 0) * BS, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def test_hash_chain_is_sha256_over_parent_salt_and_tokens():
    first = hash_block(None, [1, 2, 3, 4])
    root = hashlib.sha256(b"tokenmill prefix cache v1").digest()
    assert first == hashlib.sha256(root + array("q", [1, 2, 3, 4]).tobytes()).digest()
    second = hash_block(first, [5, 6, 7, 8])
    assert second == hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()
    # Block 1's hash depends on block 0's tokens and on the salt, through the chain.
    assert hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8]) != second
    assert extend_block_hashes([], list(range(1, 11)), BS) == [hash_block(None, [1, 2, 3, 4]),
                                                               hash_block(hash_block(None, [1, 2, 3, 4]),
                                                                          [5, 6, 7, 8])]
    salted = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], BS, salt="tenant-a")
    assert salted[0] != first and salted[1] != second


def test_lookup_checks_the_token_ids_not_only_the_hash():
    pool = BlockPool(2)
    (x,) = pool.allocate(1)
    pool.cache_block(x, b"h", [1, 2, 3, 4])
    assert pool.lookup(b"h", [1, 2, 3, 4]) == x
    assert pool.lookup(b"h", [1, 2, 3, 5]) is None  # a (forged) colliding hash with other tokens is a miss


def test_shared_prefix_hits_whole_blocks_and_keeps_the_last_token_computed():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = request(list(range(1, 12)))  # 11 tokens: blocks 0, 1 full, block 2 partial
    compute(kv, a)
    b = request(list(range(1, 10)) + [99, 98, 97])  # shares 9 tokens: 2 full blocks
    hits = kv.find_cached_prefix(b)
    assert hits == [a.block_tables[0][:2]]
    assert kv.allocate_slots(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8 and b.block_tables[0][:2] == a.block_tables[0][:2]
    assert [kv.pool.blocks[i].ref_cnt for i in a.block_tables[0][:2]] == [2, 2]
    # A prompt that is exactly two cached blocks still computes its last token: one block hit, not two.
    c = request(list(range(1, 9)))
    assert kv.find_cached_prefix(c) == [a.block_tables[0][:1]]
    kv.pool.check_integrity()


def test_different_salts_never_share():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    compute(kv, request(list(range(1, 13)), salt="a"))
    assert kv.find_cached_prefix(request(list(range(1, 13)), salt="b")) == []
    assert kv.find_cached_prefix(request(list(range(1, 13)))) == []
    assert len(kv.find_cached_prefix(request(list(range(1, 13)), salt="a"))[0]) == 2


def test_freed_blocks_stay_cached_until_the_pool_needs_them_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = request([1] * 9), request([2] * 9)  # 3 blocks each; 2 full ones are cached
    compute(kv, a)
    kv.free(a)
    compute(kv, b)  # takes a's uncached partial block and the one never used, then evicts a's LRU block
    assert kv.pool.num_evictions_total == 1
    kv.free(b)
    # a was freed tail first, so its block 1 was evicted first: block 0 still hits, block 1 no longer does.
    assert len(kv.find_cached_prefix(request([1] * 9))[0]) == 1
    assert len(kv.find_cached_prefix(request([2] * 9))[0]) == 2
    kv.pool.check_integrity()


def test_admission_with_hits_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = request(list(range(1, 10)))
    compute(kv, a)
    kv.free(a)  # 4 free blocks, 2 of them cached
    big = request(list(range(1, 9)) + list(range(50, 60)))  # 18 tokens: 2 hits + 3 new blocks > 4 free
    hits = kv.find_cached_prefix(big)
    assert len(hits[0]) == 2 and not kv.allocate_slots(big, big.num_tokens - 8, hits)
    assert big.block_tables == [] and big.num_computed_tokens == 0
    assert kv.pool.num_free_blocks == 4 and all(kv.pool.lookup(h, t) is not None for h, t in
                                                zip(big.block_hashes[:2], ([1, 2, 3, 4], [5, 6, 7, 8])))
    kv.pool.check_integrity()


def test_prefix_caching_off_never_hits_or_caches():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = request(list(range(1, 10)))
    compute(kv, a)
    assert kv.find_cached_prefix(request(list(range(1, 10)))) == []
    assert all(b.block_hash is None for b in kv.pool.blocks)
