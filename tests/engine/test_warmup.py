"""Start-up on a CPU: the synthetic steps the compiled layer stack is warmed up on (the thread layout is chosen by
engine/settle.py, tests/engine/test_settle.py)."""

import pytest

from tokenmill.engine import warmup
from tokenmill.kvcache.cache import KVCache


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
