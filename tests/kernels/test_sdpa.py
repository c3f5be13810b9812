"""Prefill attention on CPU runs SDPA's fused flash kernel, never its unfused math fallback (which materializes
[heads, L, N] scores), for GQA and MLA, with and without a cached prefix; and it computes the right thing."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.helpers import teacher_forced_logits
from tokenmill.kernels.sdpa import prefix_causal_attention
from tokenmill.kvcache.cache import KVCache
from tokenmill.models.config import ModelConfig
from tokenmill.models.deepseek import DeepseekForCausalLM
from tokenmill.models.llama import LlamaForCausalLM

FLASH, MATH = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"


def dense_reference(q, k, v, sm_scale):
    """Textbook attention: q [L, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv]; query i sees keys 0 .. N - L + i."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,nhd->hln", q, k) * sm_scale
    n, l = k.shape[0], q.shape[0]
    visible = torch.arange(n)[None, :] <= torch.arange(n - l, n)[:, None]
    return torch.einsum("hln,nhd->lhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("prefix", [0, 1, 13])
@pytest.mark.parametrize("heads,kv_heads,dim,v_dim", [(6, 2, 16, 16), (4, 4, 24, 16), (3, 1, 8, 12)])
def test_matches_dense_attention(prefix, heads, kv_heads, dim, v_dim):
    gen = torch.Generator().manual_seed(prefix * 100 + heads)
    q_len = 9
    q = torch.randn(q_len, heads, dim, generator=gen)
    k = torch.randn(prefix + q_len, kv_heads, dim, generator=gen)
    v = torch.randn(prefix + q_len, kv_heads, v_dim, generator=gen)
    out = prefix_causal_attention(q, k, v, dim ** -0.5)
    assert out.shape == (q_len, heads, v_dim)
    torch.testing.assert_close(out, dense_reference(q, k, v, dim ** -0.5), atol=2e-5, rtol=1e-5)


def _random_model(cls, config):
    torch.manual_seed(0)
    model = cls(ModelConfig.from_hf(config))
    for name, p in model.named_parameters():
        p.data.normal_(0, 0.08) if "norm" not in name else p.data.fill_(1.0)
    if getattr(model, "e_score_correction_bias", None) is not None:
        model.e_score_correction_bias.zero_()
    return model.to_device("cpu", torch.bfloat16).eval()


LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=96,
             num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=2048)
DEEPSEEK = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=1, first_k_dense_replace=1, num_attention_heads=4,
                kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=2048)


@pytest.mark.parametrize("cls,config", [(LlamaForCausalLM, LLAMA), (DeepseekForCausalLM, DEEPSEEK)],
                         ids=["gqa", "mla"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_long_prefill_takes_the_flash_kernel(cls, config, kv_dtype):
    """A 512-token prompt in one chunk (no prefix) and in two 256-token chunks (the second over a cached
    prefix): every attention call is the fused flash kernel."""
    model = _random_model(cls, config)
    ids = torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    for chunk in (None, 256):
        cache = KVCache(model.kv_cache_spec(kv_dtype, 16), num_blocks=40, device="cpu")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            logits = teacher_forced_logits(model, cache, ids, chunk=chunk)
        names = [e.name for e in prof.events()]
        assert names.count(FLASH) == (1 if chunk is None else 2), chunk
        assert MATH not in names
        assert logits.isfinite().all()
