"""The KV cache's tensors on a CPU: zeros that cost nothing until they are used."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheSpec
from tokenmill.runtime import resident_memory_bytes


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_cpu_cache_is_zeros_and_each_tensor_its_own(dtype):
    cache = KVCache(KVCacheSpec.for_gqa(3, 2, 64, dtype, 16), num_blocks=8, device="cpu")
    tensors = cache.data + [s for s in cache.scales if s is not None]
    assert len(tensors) == (6 if dtype == "fp8" else 3)
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 64 == 0
        assert torch.count_nonzero(t.float()) == 0
    cache.data[0][3].fill_(1.5)  # a block of one layer: no other layer, no other block sees it
    assert torch.count_nonzero(cache.data[0].float()) == cache.data[0][3].numel()
    assert all(torch.count_nonzero(t.float()) == 0 for t in cache.data[1:])


def test_cpu_cache_pages_become_resident_only_when_written():
    before = resident_memory_bytes()
    cache = KVCache(KVCacheSpec.for_gqa(4, 4, 128, "fp32", 16), num_blocks=2048, device="cpu")  # 512 MiB
    assert cache.nbytes > 500 * 2**20
    allocated = resident_memory_bytes()
    for data in cache.data:
        data[:64].fill_(2.0)  # 64 of 2048 blocks a layer: 16 MiB in all
    written = resident_memory_bytes()
    assert allocated - before < 32 * 2**20, "the whole cache was touched at allocation"
    assert written - allocated > 12 * 2**20, "writes did not make pages resident (is RSS readable here?)"
    assert written - allocated < 64 * 2**20
