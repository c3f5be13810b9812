"""Tiny random checkpoints of the families models/families.py serves, written by transformers (safetensors +
config + SmolLM2's tokenizer): odd head counts, windows shorter than the test prompts, more experts than a short
prompt reaches, every parameter random (norms and biases included, so that a dropped one would show)."""

from __future__ import annotations

import torch

WINDOW = 8  # shorter than every multi-token test prompt, and than a block of 16
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False)
FAMILIES = {
    "qwen3": ("Qwen3", dict(attention_bias=True)),
    "qwen3-window": ("Qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3-moe": ("Qwen3Moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    "glm4-moe": ("Glm4Moe", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                 routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5})),
    "gpt-oss": ("GptOss", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention"] * 2)),
    "gemma3": ("Gemma3Text", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                                  query_pre_attn_scalar=32, final_logit_softcapping=5.0, tie_word_embeddings=True,
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 1e4}})),
    "gemma2": ("Gemma2", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                              query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                              tie_word_embeddings=True)),
    "mistral-window": ("Mistral", dict(sliding_window=WINDOW)),
    "kimi-k2": ("DeepseekV3", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                   routed_scaling_factor=2.827, norm_topk_prob=True, kv_lora_rank=16,
                                   q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                   num_key_value_heads=6, head_dim=None)),
}
_MODEL_CLASS = {"Gemma3Text": "Gemma3ForCausalLM"}


def make_family_checkpoint(path, tokenizer, family: str, **overrides):
    """Writes the checkpoint under ``path``; returns transformers' model (fp32, eval)."""
    import transformers

    kind, extra = FAMILIES[family]
    torch.manual_seed(0)
    fields = {**COMMON, **extra, **overrides, "vocab_size": len(tokenizer)}
    fields = {k: v for k, v in fields.items() if v is not None}
    config = getattr(transformers, f"{kind}Config")(**fields)
    config.eos_token_id = tokenizer.eos_token_id
    model = getattr(transformers, _MODEL_CLASS.get(kind, f"{kind}ForCausalLM"))(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.uniform_(-1.0, 2.0)
            elif "norm" in name or name.endswith("bias"):
                p.normal_(0.0, 0.3).add_(0.0 if kind.startswith("Gemma") else 1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., cols] -> (blocks [..., cols / 32, 16] uint8, scales [..., cols / 32] uint8): the OCP microscaling
    layout gpt-oss ships (one e8m0 exponent per 32 values, the smallest that fits the block's largest value in
    e2m1's 6.0; two e2m1 codes per byte, the even-indexed value in the low nibble), round to nearest."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0 ** -120) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - FP4_GRID).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def write_mxfp4_copy(path) -> None:
    """Rewrite a gpt-oss checkpoint's expert matrices in place as MXFP4 blocks and scales, as released checkpoints
    store them: per output feature (rows of the transposed [E, out, in] matrix), with quant_method mxfp4."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = pack_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (Path(path) / "config.json").write_text(json.dumps(config))
