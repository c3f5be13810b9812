"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers, loaded by tokenmill from the directory:
logits equal transformers' (whole prefill, chunked prefill over the cached latent, absorbed decode), greedy
decoding equals transformers' for a mixed batch with chunked prefill, and the cache holds only the latent."""

import json

import pytest
import torch

from tests.conftest import hf_greedy
from tests.helpers import teacher_forced_logits
from tokenmill import LLM, SamplingParams
from tokenmill.kvcache.cache import KVCache

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.707,
        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
COMMON = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
              n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.0, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
CONFIGS = {
    "v3-q-lora": ("DeepseekV3", {"q_lora_rank": 24, "norm_topk_prob": True, "rope_parameters": YARN}),
    "v3-no-q-lora": ("DeepseekV3", {"q_lora_rank": None, "norm_topk_prob": True}),
    "v2-lite-like": ("DeepseekV2", {"q_lora_rank": None, "topk_method": "group_limited_greedy",
                                     "rope_parameters": YARN}),
}


def make_checkpoint(path, smollm_llm, kind):
    import transformers

    family, extra = CONFIGS[kind]
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(vocab_size=len(smollm_llm.tokenizer.hf), **COMMON, **extra)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    smollm_llm.tokenizer.hf.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, smollm_llm, request.param)
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB",
              max_num_batched_tokens=8)
    return request.param, path, hf, llm


def test_checkpoint_uses_released_layout(tiny):
    _, path, _, _ = tiny
    from safetensors import safe_open

    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as fh:
        names = list(fh.keys())
    assert any(".mlp.experts.0.gate_proj.weight" in n or ".mlp.experts.gate_up_proj" in n for n in names)
    assert json.loads((path / "config.json").read_text())["architectures"][0].startswith("Deepseek")


@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_logits_match_transformers(tiny, chunk):
    _, _, hf, llm = tiny
    model = llm.engine.runner.model
    ids = torch.randint(0, 1000, (40,)).tolist()  # past original_max_position_embeddings (yarn)
    cache = KVCache(model.kv_cache_spec("fp32", 4), num_blocks=16, device="cpu")
    ours = teacher_forced_logits(model, cache, ids, chunk=chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_batch_with_chunked_prefill_matches(tiny):
    _, _, hf, llm = tiny
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in (1, 6, 13, 21)]
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == [hf_greedy(hf, p, 32) for p in prompts]


def test_cache_holds_only_the_latent(tiny):
    _, _, _, llm = tiny
    c = llm.engine.runner.model.config
    assert llm.engine.kv_bytes_per_token == c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4
