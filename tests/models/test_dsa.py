"""DeepSeek Sparse Attention: tiny random DeepSeek-V3.2 and GLM-5 checkpoints written by transformers, with
``index_topk`` (6) well below the prompts, so the indexer's selection really drops tokens. tokenmill's logits equal
transformers' (whole prefill, chunked prefill over the paged cache, every position a decode), and differ from dense
attention's; greedy tokens equal transformers' under chunked prefill, prefix caching and preemption; a prompt no
longer than index_topk equals dense MLA (transformers' DeepSeek-V3 on the same weights); the selection reference
against a brute-force one, with ties and -1 padding; and the cache holds the indexer's key beside the latent."""

import json

import pytest
import torch

from tests.conftest import hf_greedy
from tests.helpers import teacher_forced_logits
from tests.tiny_checkpoints import COMMON
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.dsa import index_topk_reference
from tokenmill.kvcache.cache import KVCache

DSA = dict(q_lora_rank=24, index_topk=6, index_head_dim=16, index_n_heads=8, norm_topk_prob=True)
FAMILIES = {"DeepseekV32": {}, "GlmMoeDsa": {"indexer_types": ["full", "shared", "full"]}}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_dsa_checkpoint(path, smollm_llm, family):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(vocab_size=len(smollm_llm.tokenizer.hf), **COMMON, **DSA,
                                                      **FAMILIES[family])
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            elif "indexer.k_norm" in name:  # a LayerNorm with a bias: both must load
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    model.save_pretrained(path)
    smollm_llm.tokenizer.hf.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_dsa_checkpoint(path, smollm_llm, request.param)
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB",
              max_num_batched_tokens=8)
    return request.param, path, hf, llm


@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_logits_match_transformers(tiny, chunk):
    _, _, hf, llm = tiny
    model = llm.engine.runner.model
    ids = torch.randint(0, 1000, (24,)).tolist()
    cache = KVCache(model.kv_cache_spec("fp32", 4), num_blocks=16, device="cpu")
    ours = teacher_forced_logits(model, cache, ids, chunk=chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    if chunk is None:  # the selection matters: attending to every token gives other logits
        for layer in model.layers:
            layer.self_attn.topk = 10_000
        try:
            dense = teacher_forced_logits(model, KVCache(model.kv_cache_spec("fp32", 4), num_blocks=16, device="cpu"),
                                          ids)
        finally:
            for layer in model.layers:
                layer.self_attn.topk = DSA["index_topk"]
        assert (dense[DSA["index_topk"]:] - ref[DSA["index_topk"]:]).abs().max() > 1e-2
        torch.testing.assert_close(dense[:DSA["index_topk"]], ref[:DSA["index_topk"]], atol=2e-4, rtol=1e-4)


def test_greedy_on_the_triton_kernels(tiny, monkeypatch):
    """kernel_backend triton (Triton's interpreter on a CPU): the indexer's scores and the sparse MLA kernel run,
    with transformers' greedy tokens."""
    import tokenmill.kernels.triton.dsa as triton_dsa

    _, path, hf, _ = tiny
    calls = []
    real = triton_dsa.index_scores_triton
    monkeypatch.setattr(triton_dsa, "index_scores_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in (3, 17)]
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB",
              max_num_batched_tokens=8, kernel_backend="triton")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(prompts, params)] == [hf_greedy(hf, p, 6) for p in prompts]
    assert calls


def test_mtp_drafts_leave_the_greedy_tokens_unchanged(tmp_path, smollm_llm):
    """DeepSeek-V3.2 with its multi-token-prediction layer as released checkpoints store it (a decoder layer with its
    own indexer, after the last one): drafting with it changes no greedy token."""
    import transformers
    from safetensors.torch import save_file

    hf = make_dsa_checkpoint(tmp_path, smollm_llm, "DeepseekV32")
    c, layers = hf.config, hf.config.num_hidden_layers
    torch.manual_seed(1)
    donor = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(
        **{**c.to_dict(), "num_hidden_layers": layers + 1, "mlp_layer_types": None, "layer_types": None}))
    layer = donor.model.layers[layers]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    mtp = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    assert any(".indexer." in k for k in mtp)
    h = c.hidden_size
    mtp.update({"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "shared_head.norm.weight": torch.ones(h),
                "eh_proj.weight": 0.08 * torch.randn(h, 2 * h),
                "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
                "shared_head.head.weight": hf.lm_head.weight.detach().clone()})
    save_file({f"model.layers.{layers}.{k}": v.contiguous() for k, v in mtp.items()},
              str(tmp_path / "model-mtp.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB",
              max_num_batched_tokens=8, speculative_method="mtp", num_speculative_tokens=2)
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in (5, 17)]
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == [hf_greedy(hf, p, GREEDY.max_tokens)
                                                                    for p in prompts]
    assert llm.engine.stats().spec_num_draft_tokens_total > 0


def test_fp8_block_quantized_checkpoint(tmp_path, smollm_llm):
    """An fp8 copy of the tiny V3.2 (16x16 blocks; the indexer's weights_proj among the quantized projections)
    against transformers running the same dequantized weights."""
    import transformers

    from tests.tiny_checkpoints import write_fp8_copies

    make_dsa_checkpoint(tmp_path / "bf16", smollm_llm, "DeepseekV32")
    write_fp8_copies(tmp_path / "bf16", tmp_path, smollm_llm.tokenizer.hf, block=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    llm = LLM(model=str(tmp_path / "fp8"), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB",
              max_num_batched_tokens=8)
    ids = torch.randint(0, 1000, (24,)).tolist()
    model = llm.engine.runner.model
    ours = teacher_forced_logits(model, KVCache(model.kv_cache_spec("fp32", 4), 16, "cpu"), ids, chunk=7)
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(torch.tensor([ids])).logits[0], atol=2e-4, rtol=1e-4)


def test_short_prompts_equal_dense_mla(tiny):
    """Up to index_topk tokens every token is selected: transformers' DeepSeek-V3 (dense MLA) on the same weights."""
    import transformers

    _, path, hf, llm = tiny
    fields = {k: v for k, v in json.loads((path / "config.json").read_text()).items()
              if k in {*COMMON, "q_lora_rank", "norm_topk_prob", "vocab_size"}}
    dense = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields)).eval()
    missing, unexpected = dense.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and all(".indexer." in name for name in unexpected)
    ids = torch.randint(0, 1000, (DSA["index_topk"],)).tolist()
    model = llm.engine.runner.model
    ours = teacher_forced_logits(model, KVCache(model.kv_cache_spec("fp32", 4), num_blocks=16, device="cpu"), ids,
                                 chunk=2)
    with torch.no_grad():
        torch.testing.assert_close(ours, dense(torch.tensor([ids])).logits[0], atol=2e-4, rtol=1e-4)


def test_greedy_with_chunked_prefill_prefix_caching_and_preemption(tiny):
    _, path, hf, llm = tiny
    torch.manual_seed(1)
    shared = torch.randint(0, 1000, (16,)).tolist()  # a prefix of whole 16-token blocks: cached for the later ones
    prompts = [shared + torch.randint(0, 1000, (n,)).tolist() for n in (3, 9, 14)] + [[5, 7, 11]]
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected  # chunks of 8 tokens
    hits = llm.engine.stats().prefix_cache_hits_total
    assert llm.generate(prompts[1:2], GREEDY)[0].token_ids == expected[1]
    assert llm.engine.stats().prefix_cache_hits_total - hits == 16  # its shared block came from the cache
    need = [len(p) + GREEDY.max_tokens for p in prompts]
    capacity = max(max(need) + 16, sum(need) * 2 // 3) // 16 * 16  # one request always fits, all never do
    tight = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp32", max_model_len=capacity,
                kv_cache_memory=(capacity + 16) * llm.engine.info.kv_bytes_per_token, max_num_batched_tokens=8)
    assert [r.token_ids for r in tight.generate(prompts, GREEDY)] == expected
    assert tight.engine.scheduler.num_preemptions_total >= 1


def test_cache_holds_the_indexer_key_beside_the_latent(tiny):
    _, _, _, llm = tiny
    c = llm.engine.runner.model.config
    per_layer = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim + c.dsa.index_head_dim
    assert llm.engine.info.kv_bytes_per_token == c.num_layers * per_layer * 4


def brute_force_topk(q, w, k, positions, topk):
    out = []
    for row in range(q.shape[0]):
        scores = [(sum(float(w[row, h]) * max(0.0, float(q[row, h] @ k[j])) for h in range(q.shape[1])), j)
                  for j in range(int(positions[row]) + 1)]
        out.append({j for _, j in sorted(scores, key=lambda s: -s[0])[:topk]})
    return out


@pytest.mark.parametrize("length, topk", [(1, 4), (4, 4), (16, 4), (13, 5)])
def test_selection_against_brute_force(length, topk):
    torch.manual_seed(length)
    q, w, k = torch.randn(length, 16, 8), torch.randn(length, 16), torch.randn(length, 8)  # no ReLU-zero ties
    positions = torch.arange(length)
    chosen = index_topk_reference(q, w, k, positions, topk)
    assert chosen.shape == (length, min(topk, length))
    for row, want in enumerate(brute_force_topk(q, w, k, positions, topk)):
        got = {int(j) for j in chosen[row] if j >= 0}
        assert got == want and int((chosen[row] < 0).sum()) == min(topk, length) - len(want)


def test_ties_keep_the_earliest_of_equal_scores_only_up_to_topk():
    """Every score 0 (all ReLU'd away): any topk of the causal keys, never a future one, none twice."""
    q, k = -torch.ones(6, 2, 4), torch.ones(6, 4)
    chosen = index_topk_reference(q, torch.ones(6, 2), k, torch.arange(6), 3)
    for row in range(6):
        picked = [int(j) for j in chosen[row] if j >= 0]
        assert len(picked) == len(set(picked)) == min(3, row + 1) and max(picked) <= row


@pytest.mark.parametrize("family", list(FAMILIES))
def test_served_under_tensor_parallel_2(tmp_path, smollm_llm, family):
    """/v1/completions on two ranks (heads and experts split, the indexer whole on each) with chunked prefill (8-token
    steps), prefix caching (a 16-token block shared with an earlier request) and preemption (a 64-token pool for four
    requests of up to 40): the greedy tokens of transformers."""
    import re

    import httpx

    from tests.live_server import start_server, stop_server

    hf = make_dsa_checkpoint(tmp_path / "model", smollm_llm, family)
    server = start_server(tmp_path, str(tmp_path / "model"), "--tensor-parallel-size", "2", "--num-threads", "1",
                          "--dtype", "float32", "--kv-cache-dtype", "fp32", "--max-num-batched-tokens", "8",
                          "--max-model-len", "48", "--kv-cache-memory", str(64 * 3 * (16 + 8 + 16) * 4),
                          "--admission-overcommit", "10")
    try:
        torch.manual_seed(2)
        shared = torch.randint(0, 1000, (16,)).tolist()
        prompts = [shared + torch.randint(0, 1000, (n,)).tolist() for n in (3, 9, 14)] + [[5, 7, 11]]

        def complete(batch):
            body = {"model": "model", "prompt": batch, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                    "skip_special_tokens": False}
            answer = httpx.post(server.base_url + "/completions", json=body, timeout=120).json()
            return [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
        expected = [smollm_llm.tokenizer.hf.decode(hf_greedy(hf, p, 10)) for p in prompts]
        assert complete(prompts[:1]) == expected[:1]
        assert complete(prompts) == expected
        metrics = server.metrics_text()
        hits = float(re.search(r"tokenmill:prefix_cache_hits_total\{[^}]*\} (\S+)", metrics).group(1))
        preemptions = float(re.search(r"tokenmill:num_preemptions_total\{[^}]*\} (\S+)", metrics).group(1))
        assert hits >= 16 and preemptions >= 1, (hits, preemptions)
    finally:
        stop_server(server)


def test_plan_presets_count_the_indexer_key():
    from tokenmill.bench.presets import PRESETS
    from tokenmill.models.config import ModelConfig

    for name, layers in (("deepseek-v3.2", 61), ("glm-5", 78)):
        c = ModelConfig.from_hf(PRESETS[name])
        assert c.dsa.index_topk == 2048
        assert c.kv_cache_spec("bf16", 16).bytes_per_token == layers * (512 + 64 + 128) * 2
        assert c.kv_cache_spec("fp8", 16).bytes_per_token == layers * (512 + 64 + 128 + 4)  # + a scale per token


def test_indexer_types_as_glm_5_configs_give_them():
    from tokenmill.bench.presets import PRESETS
    from tokenmill.models.config import ModelConfig

    base = {**PRESETS["glm-5"], "num_hidden_layers": 6}
    assert ModelConfig.from_hf(base).dsa.layer_types == ("full",) * 6
    assert ModelConfig.from_hf({**base, "index_topk_pattern": "FSSFSS"}).dsa.layer_types == \
        ("full", "shared", "shared", "full", "shared", "shared")
    # transformers' schedule: full where max(i - offset + 1, 0) % freq == 0
    assert ModelConfig.from_hf({**base, "index_topk_freq": 2, "index_skip_topk_offset": 2}).dsa.layer_types == \
        ("full", "full", "shared", "full", "shared", "full")
    with pytest.raises(ValueError, match="indexer_types"):
        ModelConfig.from_hf({**base, "indexer_types": ["shared"] + ["full"] * 5})
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelConfig.from_hf({**base, "q_lora_rank": None})
