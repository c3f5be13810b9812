import pytest

from tokenmill.kvcache.block_pool import BlockPool, NoFreeBlocksError
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.kvcache.spec import KVCacheSpec


def test_allocate_free_lru_order_and_integrity():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert sorted(a + b) == [0, 1, 2, 3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(reversed(a))  # a[1] freed first -> evicted first
    pool.check_integrity()
    assert pool.allocate(1) == [a[1]]
    pool.check_integrity()
    assert pool.num_free_blocks == 1


def test_double_free_is_caught():
    pool = BlockPool(2)
    (x,) = pool.allocate(1)
    pool.free([x])
    with pytest.raises(RuntimeError):
        pool.free([x])


def test_cached_block_survives_free_until_evicted():
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    pool.cache_block(x, b"h0", [1, 2])
    pool.free([x])
    assert pool.lookup(b"h0", [1, 2]) == x
    pool.acquire(x)  # a prefix hit revives it without allocation
    assert pool.blocks[x].ref_cnt == 1 and pool.num_free_blocks == 0
    pool.check_integrity()
    pool.free([x, y])
    # x was freed first, so it is evicted first and loses its hash.
    assert pool.allocate(1) == [x]
    assert pool.lookup(b"h0", [1, 2]) is None
    pool.check_integrity()


class _Req:
    def __init__(self):
        self.block_tables, self.num_computed_tokens, self.num_cached_blocks = [], 0, 0


def test_manager_allocates_by_ceil_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    r = _Req()
    assert kv.allocate_slots(r, 5) and len(r.block_tables[0]) == 2
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3) and len(r.block_tables[0]) == 2  # 8 tokens fit in 2 blocks
    assert kv.allocate_slots(r, 4) and len(r.block_tables[0]) == 3
    assert not kv.allocate_slots(r, 100)
    kv.free(r)
    assert r.block_tables == [] and kv.pool.num_free_blocks == 5


def test_spec_bytes_per_token_formula():
    # 2 (K and V) x layers x kv_heads x head_dim x element bytes, + a float32 scale per (token, head) for fp8.
    fp8 = KVCacheSpec.for_gqa(num_layers=30, num_kv_heads=3, head_dim=64, dtype="fp8", block_size=16)
    assert fp8.bytes_per_token == 2 * 30 * 3 * 64 * 1 + 2 * 30 * 3 * 4
    bf16 = KVCacheSpec.for_gqa(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bf16", block_size=16)
    assert bf16.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert bf16.num_blocks_for(bf16.bytes_per_block * 7 + 1) == 7
