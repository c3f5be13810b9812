"""The capacity planner against formulas, transformers' own parameter counts, and the engine's allocation."""

import pytest
import torch

from tokenmill.bench.plan import PRESETS, Plan, kv_spec, mha_equivalent_bytes_per_token, num_parameters
from tokenmill.kvcache.cache import KVCache

GiB = 2**30


def test_llama2_7b_sequence_is_2gib_in_bf16():
    plan = Plan("llama-2-7b", PRESETS["llama-2-7b"], context=4096, memory=80 * GiB, utilization=0.9)
    per_token = kv_spec(plan.config, "bf16").bytes_per_token
    assert per_token == 2 * 32 * 32 * 128 * 2
    assert per_token * 4096 == 2 * GiB
    free = int(80 * GiB * 0.9) - num_parameters(plan.config) * 2
    assert plan.sequences_that_fit("bf16", "bf16") == free // (2 * GiB)


def test_deepseek_v3_latent_cache():
    c = PRESETS["deepseek-v3"]
    assert kv_spec(c, "bf16").bytes_per_token == (512 + 64) * 61 * 2
    assert kv_spec(c, "fp8").bytes_per_token == (512 + 64) * 61 * 1 + 61 * 4  # one float32 scale per layer
    # Full per-head K (128 nope + 64 rope) and V (128) for 128 heads would be 71x larger.
    assert mha_equivalent_bytes_per_token(c, "bf16") == 61 * 128 * (192 + 128) * 2
    assert mha_equivalent_bytes_per_token(c, "bf16") / kv_spec(c, "bf16").bytes_per_token == pytest.approx(71.1, 0.01)


def _transformers_model(name: str):
    """The preset as transformers builds it, on the meta device, with at most 4 layers (the count is per layer)."""
    import transformers

    c = dict(PRESETS[name])
    arch = c.pop("architectures")[0]
    c["num_hidden_layers"] = min(c["num_hidden_layers"], 4)
    if "layer_types" in c:
        c["layer_types"] = c["layer_types"][:4]
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                  "Glm4MoeForCausalLM": "glm4_moe", "GptOssForCausalLM": "gpt_oss", "Gemma3ForCausalLM": "gemma3_text",
                  "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                  "DeepseekV32ForCausalLM": "deepseek_v32", "GlmMoeDsaForCausalLM": "glm_moe_dsa"}[arch]
    with torch.device("meta"):
        model = getattr(transformers, arch)(transformers.AutoConfig.for_model(model_type, **c))
    return {**c, "architectures": [arch]}, model


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_matches_transformers(name):
    config, model = _transformers_model(name)
    # The routers' correction biases (GLM, DeepSeek-V3) are buffers in transformers, parameters here.
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert num_parameters(config) == model.num_parameters() + biases


def test_matches_the_engine_allocation(smollm_llm):
    engine = smollm_llm.engine
    spec = kv_spec(PRESETS["smollm2-135m"], "fp32")
    assert spec.bytes_per_token == engine.info.kv_bytes_per_token
    cache = engine.runner.kv_cache
    # The engine's real tensors: every block (and the null block) holds block_size tokens at bytes_per_token.
    assert cache.nbytes == (cache.num_blocks + 1) * spec.block_size * spec.bytes_per_token
    fp8 = KVCache(kv_spec(PRESETS["smollm2-135m"], "fp8"), num_blocks=3, device="cpu")
    assert fp8.nbytes == 4 * 16 * kv_spec(PRESETS["smollm2-135m"], "fp8").bytes_per_token


def _shard_numel(name: str, numel: int, tp: int, kv_heads: int) -> float:
    """One rank's share of a named parameter of a transformers model, by the usual tensor/expert-parallel split:
    read off the module names, not from the planner's formulas."""
    leaf = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
    if name.endswith("o_proj.bias"):
        return numel  # a row-parallel layer's bias: whole on every rank (added once, after the all-reduce)
    if ".experts." in name or leaf in ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_b_proj",
                                       "kv_b_proj", "embed_tokens", "lm_head", "gate_up_proj", "sinks"):
        return numel / tp
    if leaf in ("k_proj", "v_proj"):
        return numel * max(1, kv_heads // tp) / kv_heads
    return numel  # norms, the router, MLA's q_a / kv_a: replicated


@pytest.mark.parametrize("name, tps", [("llama-3-8b", [1, 2, 8, 16]), ("smollm2-135m", [3]),
                                       ("deepseek-v2-lite", [2, 4]), ("deepseek-v3", [8]), ("qwen3-30b-a3b", [2, 4]),
                                       ("gpt-oss-20b", [2, 8]), ("gemma-3-27b", [2])])
def test_per_rank_parameters_match_the_split_of_the_real_modules(name, tps):
    from tokenmill.bench.plan import rank_parameters

    config, model = _transformers_model(name)
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    tied = config.get("tie_word_embeddings", False)
    for tp in tps:
        shares = sum(_shard_numel(n, p.numel(), tp, kv_heads) for n, p in model.named_parameters()
                     if not (tied and n == "lm_head.weight"))
        shares += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
        # The planner pads the vocabulary to a multiple of tp (vocab-parallel shards): < 2 rows of hidden_size apart.
        assert rank_parameters(config, tp) == pytest.approx(shares, abs=2 * config["hidden_size"])


def test_per_rank_kv_cache():
    from tokenmill.bench.plan import rank_kv_spec

    llama = PRESETS["llama-3-8b"]  # 8 KV heads
    assert rank_kv_spec(llama, "bf16", 2).bytes_per_token == kv_spec(llama, "bf16").bytes_per_token // 2
    assert rank_kv_spec(llama, "bf16", 16).bytes_per_token == kv_spec(llama, "bf16").bytes_per_token // 8  # 1 head
    v3 = PRESETS["deepseek-v3"]  # the latent is replicated: every rank stores all of it
    assert rank_kv_spec(v3, "fp8", 8).bytes_per_token == kv_spec(v3, "fp8").bytes_per_token
    plan = Plan("deepseek-v3", v3, context=4096, memory=141 * 10**9, utilization=0.9, tensor_parallel_size=8)
    free = int(141 * 10**9 * 0.9) - plan.weight_bytes("fp8")
    assert plan.sequences_that_fit("fp8", "fp8") == free // (kv_spec(v3, "fp8").bytes_per_token * 4096)
    with pytest.raises(ValueError, match="attention heads"):
        Plan("deepseek-v3", v3, 4096, 141 * 10**9, 0.9, tensor_parallel_size=3).weight_bytes("fp8")


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8"])
def test_quantized_weight_bytes_match_the_served_engine(tmp_path, smollm_llm, mode):
    """``tokenmill plan --weight-dtype int8|int4|fp8`` and the weight bytes a bf16 engine serving the same checkpoint
    with ``--quantization`` of that kind holds (what /metrics shows as tokenmill:model_weight_bytes)."""
    import json

    from tests.tiny_checkpoints import make_llama_checkpoint
    from tokenmill import LLM

    make_llama_checkpoint(tmp_path, smollm_llm)
    config = json.loads((tmp_path / "config.json").read_text())
    llm = LLM(model=str(tmp_path), dtype="bfloat16", quantization=mode, kv_cache_memory="16MiB")
    plan = Plan("tiny", config, context=256, memory=GiB, utilization=0.9)
    assert plan.weight_bytes(mode) == llm.engine.info.weight_bytes
    assert plan.weight_bytes(mode) < plan.weight_bytes("bf16")


@pytest.mark.parametrize("name, full_layers, window_layers, window", [("gemma-3-27b", 10, 52, 1024),
                                                                      ("gpt-oss-20b", 12, 12, 128)])
def test_a_sequence_holds_only_the_window_of_its_sliding_layers(name, full_layers, window_layers, window):
    plan = Plan(name, PRESETS[name], context=8192, memory=141 * 10**9, utilization=0.9)
    c = PRESETS[name]
    per_layer_token = 2 * c["num_key_value_heads"] * c["head_dim"] * 2  # K and V, bf16
    assert plan.kv_bytes_per_token("bf16") == (full_layers + window_layers) * per_layer_token
    ideal = per_layer_token * (full_layers * 8192 + window_layers * window)
    per_sequence = plan.kv_bytes_per_sequence("bf16")
    # Above the ideal only by what the blocks round up: padded groups, the block the next query falls in.
    assert ideal <= per_sequence <= ideal * 1.06
    free = int(141 * 10**9 * 0.9) - plan.weight_bytes("bf16")
    assert plan.sequences_that_fit("bf16", "bf16") == free // per_sequence
