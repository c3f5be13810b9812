"""fp8 KV cache (with per-token, per-head scales) stays close to fp32 KV on SmolLM2."""

from tests.conftest import PROMPTS
from tests.helpers import fp8_kv_kl


def test_fp8_kv_kl_per_position_below_threshold(smollm_llm):
    """Chunks of 4 tokens: each prediction reads all of its context but the (at most 3) tokens before it in its
    chunk back from the cache, nearly the worst case for a quantized cache at a quarter of the steps."""
    model = smollm_llm.engine.runner.model
    text = " ".join(PROMPTS[2:]) + " " + PROMPTS[4]
    ids = smollm_llm.tokenizer.encode(text)[:280]
    assert len(ids) >= 256
    # KL(p_fp32 || p_fp8) per position, averaged over all positions of the text.
    kl = fp8_kv_kl(model, ids, block_size=16, num_blocks=64, chunk=4)
    print(f"fp8 vs fp32 KV: mean KL {kl.mean():.5f}, max {kl.max():.5f} over {len(ids)} tokens")
    assert kl.mean() < 0.02
    assert kl.mean() > 0  # the fp8 path really quantizes


def test_reported_kv_bytes_per_token(smollm_llm):
    a = smollm_llm.engine.runner.model.config
    assert smollm_llm.engine.info.kv_bytes_per_token == 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4  # fp32
    fp8 = smollm_llm.engine.runner.model.kv_cache_spec("fp8", 16)
    # SmolLM2: 30 layers, 3 KV heads of 64 dims; fp8 adds one float32 scale per (token, head) for K and for V.
    assert fp8.bytes_per_token == 2 * 30 * 3 * 64 * 1 + 2 * 30 * 3 * 4
