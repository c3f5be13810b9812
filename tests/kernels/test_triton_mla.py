"""Triton MLA decode against the PyTorch reference over a paged latent cache with paging traps (permuted block
tables, NaN in every unused slot, lengths 1 / block-aligned / unaligned), fp8 and 16/32-bit caches, ranks that
are and are not powers of two (DeepSeek-V3's 512 + 64 included), head counts that do not fill a head group, and
split-KV decode with the log-sum-exp merge."""

import pytest
import torch

from tests.kernels.paging import block_tables, fill_pool_with_nan, picker
from tests.kernels.triton_device import DEVICE
from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.mla import mla_decode
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheSpec

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}  # bf16: two ulps (eps 2**-7)


def latent_cache(lens, rank, rope, kv_dtype, block_size, dtype, num_blocks=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(KVCacheSpec(1, 1, rank + rope, kv_dtype, block_size), num_blocks, "cpu")
    data, scales = cache.layer(0)
    fill_pool_with_nan(data, scales, num_blocks)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lens:
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        latent = torch.cat([torch.randn(n, rank, generator=gen), 2 * torch.randn(n, rope, generator=gen)], -1)
        pos = torch.arange(n)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        write_kv(data, scales, latent.to(dtype)[:, None, :], slots)
    tables_t = block_tables(tables, cache.null_block)
    return data.to(DEVICE), None if scales is None else scales.to(DEVICE), tables_t.to(DEVICE)


@pytest.mark.parametrize("kv_dtype,dtype", [("fp8", torch.float32), ("fp8", torch.float16), ("fp8", torch.bfloat16),
                                            ("fp16", torch.float16), ("bf16", torch.bfloat16), ("bf16", torch.float32),
                                            ("fp32", torch.float32)])
@pytest.mark.parametrize("rank,rope,heads", [(48, 8, 20), (512, 64, 16)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_mla_decode_matches_reference(kv_dtype, dtype, rank, rope, heads, num_splits):
    from tokenmill.kernels.triton.mla import mla_decode_triton

    lens = [1, 16, 21, 70]
    block_size = 8
    data, scales, tables = latent_cache(lens, rank, rope, kv_dtype, block_size, dtype)
    gen = torch.Generator().manual_seed(1)
    q_lat = (torch.randn(len(lens), heads, rank, generator=gen) * 0.2).to(dtype).to(DEVICE)
    q_pe = torch.randn(len(lens), heads, rope, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q_lat, q_pe, data, scales, tables, seq_lens, block_size, (128 + rope) ** -0.5)
    want = mla_decode(*args, backend="torch")
    got = mla_decode_triton(*args, num_splits=num_splits)
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_reference(seed):
    from tokenmill.kernels.triton.mla import mla_decode_triton

    gen = torch.Generator().manual_seed(seed)
    pick = picker(gen)
    rank, rope, heads = pick([16, 48, 96, 512]), pick([8, 16, 64]), pick([1, 5, 16, 33])
    block_size, kv_dtype = pick([1, 4, 16]), pick(["fp8", "fp32"])
    lens = torch.randint(1, 90, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
    data, scales, tables = latent_cache(lens, rank, rope, kv_dtype, block_size, torch.float32, num_blocks=512,
                                        seed=seed)
    q_lat = (torch.randn(len(lens), heads, rank, generator=gen) * 0.2).to(DEVICE)
    q_pe = torch.randn(len(lens), heads, rope, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q_lat, q_pe, data, scales, tables, seq_lens, block_size, 0.1)
    got = mla_decode_triton(*args, num_splits=pick([1, 3]))
    torch.testing.assert_close(got, mla_decode(*args, backend="torch"), atol=2e-5, rtol=2e-5)
