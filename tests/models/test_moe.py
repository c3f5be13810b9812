"""The MoE layer (router + fused_moe reference + shared experts) against transformers' DeepSeek-V2/V3 modules."""

import pytest
import torch

from tokenmill.kernels.fused_moe import fused_moe_reference
from tokenmill.models.config import ModelConfig
from tokenmill.models.layers.moe import MoE

COMMON = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=64, n_routed_experts=8,
              n_shared_experts=2, routed_scaling_factor=2.5, num_hidden_layers=1, num_attention_heads=2,
              vocab_size=100)


def hf_moe(version: str, **overrides):
    import transformers

    torch.manual_seed(0)
    if version == "v3":
        config = transformers.DeepseekV3Config(**{**COMMON, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                                                  "norm_topk_prob": True, **overrides})
        module = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config)
    else:
        config = transformers.DeepseekV2Config(**{**COMMON, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                                                  **overrides})
        module = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
        if version == "v3":
            module.gate.e_score_correction_bias.normal_(0, 0.2)
    return config, module.eval()


def ours_from(config, module) -> MoE:
    hf_cfg = {**config.to_dict(), "architectures": [type(config).__name__.replace("Config", "ForCausalLM")]}
    moe = MoE(config.hidden_size, ModelConfig.from_hf(hf_cfg).moe)
    with torch.no_grad():
        moe.gate_weight.copy_(module.gate.weight)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.copy_(module.gate.e_score_correction_bias)
        moe.w_gate_up.copy_(module.experts.gate_up_proj)
        moe.w_down.copy_(module.experts.down_proj)
        shared = module.shared_experts
        moe.shared_experts.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        moe.shared_experts.down_proj.weight.copy_(shared.down_proj.weight)
    return moe


@pytest.mark.parametrize("version,overrides", [
    ("v3", {}),  # sigmoid + correction bias + grouped top-k, normalized
    ("v3", {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}),
    ("v2", {"topk_method": "greedy"}),
    ("v2", {"topk_method": "group_limited_greedy"}),
])
def test_moe_matches_transformers(version, overrides):
    config, module = hf_moe(version, **overrides)
    ours = ours_from(config, module)
    x = torch.randn(1, 23, config.hidden_size)
    with torch.no_grad():
        expected = module(x)[0]
        got = ours(x[0])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fused_moe_reference_against_dense_formula():
    torch.manual_seed(1)
    t, h, inter, experts, k = 9, 16, 8, 6, 2
    x = torch.randn(t, h)
    w_gate_up, w_down = torch.randn(experts, 2 * inter, h), torch.randn(experts, h, inter)
    ids = torch.tensor([[0, 1]] * t)  # experts 2..5 get no tokens
    weights = torch.rand(t, k)
    out = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    expected = torch.zeros(t, h)
    for e, col in ((0, 0), (1, 1)):
        gate, up = (x @ w_gate_up[e].T).split(inter, dim=-1)
        expected += weights[:, col, None] * ((torch.nn.functional.silu(gate) * up) @ w_down[e].T)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
