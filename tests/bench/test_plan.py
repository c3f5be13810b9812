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


@pytest.mark.parametrize("name", ["llama-3-8b", "smollm2-135m", "deepseek-v2-lite", "deepseek-v3"])
def test_parameter_count_matches_transformers(name):
    import transformers

    c = dict(PRESETS[name])
    arch = c.pop("architectures")[0]
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "DeepseekV2ForCausalLM": transformers.DeepseekV2Config,
                  "DeepseekV3ForCausalLM": transformers.DeepseekV3Config}[arch]
    # Fewer layers keep the meta-device build fast; the count is per layer anyway.
    c["num_hidden_layers"] = min(c["num_hidden_layers"], 4)
    config = config_cls(**c)
    with torch.device("meta"):
        model = getattr(transformers, arch)(config)
    assert num_parameters({**c, "architectures": [arch]}) == model.num_parameters()


def test_matches_the_engine_allocation(smollm_llm):
    engine = smollm_llm.engine
    spec = kv_spec(PRESETS["smollm2-135m"], "fp32")
    assert spec.bytes_per_token == engine.info.kv_bytes_per_token
    cache = engine.runner.kv_cache
    # The engine's real tensors: every block (and the null block) holds block_size tokens at bytes_per_token.
    assert cache.nbytes == (cache.num_blocks + 1) * spec.block_size * spec.bytes_per_token
    fp8 = KVCache(kv_spec(PRESETS["smollm2-135m"], "fp8"), num_blocks=3, device="cpu")
    assert fp8.nbytes == 4 * 16 * kv_spec(PRESETS["smollm2-135m"], "fp8").bytes_per_token
