"""Populating a CPU KV cache (kvcache/populate.py): its pages become resident and nothing in them changes; a refusal
is reported, not raised; an engine populated at start-up generates what a lazy one does."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.populate import populate
from tokenmill.kvcache.spec import KVCacheSpec
from tokenmill.runtime import resident_memory_bytes


def cache_of(mib: int, dtype: str = "fp32") -> KVCache:
    spec = KVCacheSpec.for_gqa(4, 4, 128, dtype, 16)  # fp32: 256 KiB a block over 4 layers, 64 KiB a layer
    return KVCache(spec, num_blocks=mib * 2**20 // (4 * 64 * 2**10), device="cpu")


@pytest.mark.parametrize("threads", [1, 3])
def test_populate_makes_the_cache_resident_and_keeps_what_was_written(threads):
    cache = cache_of(96)
    for i, data in enumerate(cache.data):
        data[5].fill_(i + 1.5)
    before = resident_memory_bytes()
    cache.populate("startup", threads)
    grown = resident_memory_bytes() - before
    assert cache.populated_bytes == cache.nbytes
    assert grown > 0.9 * cache.nbytes, f"{grown} bytes became resident of {cache.nbytes}"
    for i, data in enumerate(cache.data):
        assert torch.all(data[5] == i + 1.5)
        assert torch.count_nonzero(torch.cat([data[:5].flatten(), data[6:].flatten()])) == 0


def test_lazy_populates_nothing():
    cache = cache_of(64)
    before = resident_memory_bytes()
    cache.populate("lazy")
    assert cache.populated_bytes == 0
    assert resident_memory_bytes() - before < 16 * 2**20


def test_a_refused_madvise_is_reported_not_raised():
    done, problem = populate([(4096, 4096)])  # page 1 of the address space: never mapped
    assert done == 0 and problem is not None and "MADV_POPULATE_WRITE" in problem


def test_modes_are_checked():
    with pytest.raises(ValueError, match="kv_cache_populate"):
        cache_of(1).populate("eager")
    assert EngineConfig(kv_cache_populate="lazy").kv_cache_populate == "lazy"
    with pytest.raises(ValueError):
        EngineConfig(kv_cache_populate="background")


def test_an_engine_populated_at_startup_generates_what_a_lazy_one_does(tmp_path, smollm_llm):
    from tests.tiny_checkpoints import make_llama_checkpoint
    from tokenmill import LLM, SamplingParams

    make_llama_checkpoint(tmp_path, smollm_llm)
    common = dict(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="24MiB")
    populated, lazy = LLM(**common, kv_cache_populate="startup"), LLM(**common, kv_cache_populate="lazy")
    cache = populated.engine.runner.kv_cache
    assert cache.populated_bytes == cache.nbytes > 20 * 2**20
    assert lazy.engine.runner.kv_cache.populated_bytes == 0
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 60))]
    assert [r.token_ids for r in populated.generate(prompts, params)] == \
        [r.token_ids for r in lazy.generate(prompts, params)]
