"""Start-up on a CPU: the thread layout chosen by timing the model, and the synthetic steps it is timed on."""

import pytest
import torch

from tokenmill.engine import warmup
from tokenmill.kvcache.cache import KVCache


@pytest.mark.parametrize("fewer_over_all,expected", [((1.02, 0.95), 1), ((0.94, 1.25), 2), ((1.6, 1.9), 2)])
def test_one_core_is_left_to_the_api_only_where_the_engine_loses_nothing(monkeypatch, smollm_llm, fewer_over_all,
                                                                         expected):
    def fake_seconds(model, kv_cache, batch, repeats=5):
        slow = fewer_over_all[warmup.THREAD_PROBE_BATCHES.index(batch)]
        return slow if torch.get_num_threads() == 1 else 1.0
    monkeypatch.setattr(warmup, "_decode_seconds", fake_seconds)
    threads = torch.get_num_threads()
    try:
        runner = smollm_llm.engine.runner
        assert warmup.choose_num_threads(runner.model, runner.kv_cache, 2) == expected
        assert torch.get_num_threads() == expected
        assert warmup.choose_num_threads(runner.model, runner.kv_cache, 1) == 1
    finally:
        torch.set_num_threads(threads)


def test_decode_timing_runs_the_model(smollm_llm):
    runner = smollm_llm.engine.runner
    assert 0 < warmup._decode_seconds(runner.model, runner.kv_cache, 2, repeats=1) < 60


@pytest.mark.parametrize("requests,tokens,context", [(1, 1, 16), (4, 1, 37), (1, 2, 16), (3, 5, 20)])
def test_synthetic_steps_address_the_cache_consistently(smollm_llm, requests, tokens, context):
    spec = smollm_llm.engine.runner.kv_cache.spec
    cache = KVCache(spec, num_blocks=16, device="cpu")
    input_ids, positions, meta = warmup.synthetic_step(cache, requests, tokens, context)
    n = len(meta.seq_lens)
    assert n == min(requests, 16 // -(-context // spec.block_size))
    assert input_ids.shape == positions.shape == meta.slot_mapping.shape == (n * tokens,)
    assert positions.tolist() == list(range(context - tokens, context)) * n
    assert meta.query_start_loc == [i * tokens for i in range(n + 1)] and meta.seq_lens == [context] * n
    assert (meta.decode_indices if tokens == 1 else meta.prefill_indices) == list(range(n))
    slots = meta.slot_mapping.tolist()
    assert len(set(slots)) == len(slots) and max(slots) < cache.num_blocks * spec.block_size  # null block untouched
    # Each token's slot is its position inside its own request's blocks.
    for row, (slot, pos) in enumerate(zip(slots, positions.tolist())):
        table = meta.block_tables[row // tokens]
        assert slot == table[pos // spec.block_size] * spec.block_size + pos % spec.block_size
