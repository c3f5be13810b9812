"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers, loaded by tokenmill from the directory:
logits equal transformers' (whole prefill, chunked prefill over the cached latent, absorbed decode), greedy
decoding equals transformers' for a mixed batch with chunked prefill, and the cache holds only the latent."""

import json

import pytest
import torch

from tests.conftest import hf_greedy
from tests.helpers import fp8_kv_kl, teacher_forced_logits
from tokenmill import LLM, SamplingParams
from tokenmill.kvcache.cache import KVCache
from tests.tiny_checkpoints import CONFIGS, make_deepseek_checkpoint, write_fp8_copies

@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_deepseek_checkpoint(path, smollm_llm, request.param)
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
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    assert llm.generate([prompts[2]], params)[0].token_ids == expected[2]  # and alone


def test_cache_holds_only_the_latent(tiny):
    _, _, _, llm = tiny
    c = llm.engine.runner.model.config
    assert llm.engine.info.kv_bytes_per_token == c.num_layers * (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) * 4


def test_fp8_latent_cache_kl_below_threshold(tiny):
    _, _, _, llm = tiny
    model = llm.engine.runner.model
    ids = torch.randint(0, 1000, (64,)).tolist()
    kl = fp8_kv_kl(model, ids, block_size=4, num_blocks=20)
    print(f"MLA fp8 latent vs fp32: mean KL {kl.mean():.6f}")
    assert 0 < kl.mean() < 0.02


def test_real_deepseek_v3_config_kv_bytes():
    from tokenmill.bench.plan import PRESETS, mha_equivalent_bytes_per_token
    from tokenmill.models.config import ModelConfig
    from tokenmill.models.deepseek import DeepseekForCausalLM

    config = {**PRESETS["deepseek-v3"], "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
              "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                               "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
              "rope_theta": 10000, "max_position_embeddings": 4096}
    with torch.device("meta"):
        model = DeepseekForCausalLM(ModelConfig.from_hf(config))
    fp8, bf16 = model.kv_cache_spec("fp8", 64), model.kv_cache_spec("bf16", 64)
    assert bf16.bytes_per_token == (512 + 64) * 61 * 2
    assert fp8.bytes_per_token == (512 + 64) * 61 * 1 + 61 * 4  # + one float32 scale per token and layer
    ratio = mha_equivalent_bytes_per_token(config, "bf16") / bf16.bytes_per_token
    print(f"DeepSeek-V3: full per-head K/V would take {ratio:.1f}x the latent cache")
    assert ratio > 70


def test_served_chat_stream(tmp_path, smollm_llm):
    import openai

    from tests.live_server import FP32, start_server, stop_server

    path = tmp_path / "tiny-v3"
    make_deepseek_checkpoint(path, smollm_llm, "v3-q-lora")
    # The engine on a thread of the API process (--no-engine-process): the in-process transport serves too.
    server = start_server(tmp_path, "--kv-cache-memory", "8MiB", "--max-model-len", "256", *FP32,
                          "--no-engine-process", str(path))
    try:
        assert "engine process started" not in server.log()
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(
            model=path.name, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, stream=True,
            temperature=0, extra_body={"ignore_eos": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        whole = client.chat.completions.create(model=path.name, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens == 12
    finally:
        stop_server(server)


def test_fp8_block_quantized_checkpoint(tmp_path, smollm_llm):
    """An fp8 copy of the tiny V3 weights (16x16 blocks, partial edge blocks included) against transformers
    running the same dequantized weights."""
    import transformers

    src = tmp_path / "bf16"
    make_deepseek_checkpoint(src, smollm_llm, "v3-q-lora")
    write_fp8_copies(src, tmp_path, smollm_llm.tokenizer.hf, block=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    llm = LLM(model=str(tmp_path / "fp8"), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB",
              max_num_batched_tokens=8)
    ids = torch.randint(0, 1000, (30,)).tolist()
    model = llm.engine.runner.model
    ours = teacher_forced_logits(model, KVCache(model.kv_cache_spec("fp32", 4), 16, "cpu"), ids, chunk=7)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in (3, 17)]
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == [hf_greedy(hf, p, 32) for p in prompts]
