"""Tiny random checkpoints written by transformers (safetensors + config + SmolLM2's tokenizer) for the tests:
a Llama/Qwen2 (GQA) and DeepSeek-V2/V3 (MLA + MoE) in their released layouts. Returns transformers' model."""

import json

import torch


def make_llama_checkpoint(path, smollm_llm, arch="llama", rope=None, num_kv_heads=2, extra_vocab=0, head_dim=16):
    """``extra_vocab``: rows past the tokenizer's (as padded vocabularies have; never sampled by a trained model);
    ``head_dim``: a Llama's (Qwen2's is hidden / heads, 16)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=len(smollm_llm.tokenizer.hf) + extra_vocab, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, head_dim=head_dim, rope_theta=10000.0)
        if rope:
            config.rope_parameters = {"rope_theta": 10000.0, **rope}
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # random biases so that a dropped bias would show
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_()
    model.save_pretrained(path)
    smollm_llm.tokenizer.hf.save_pretrained(path)
    return model.eval()


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


def make_deepseek_checkpoint(path, smollm_llm, kind):
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


def make_mtp_checkpoint(path, smollm_llm):
    """A tiny DeepSeek-V3 ("v3-q-lora") with one multi-token-prediction layer stored as released checkpoints store
    it: a decoder layer (MLA + MoE) under ``model.layers.{L}`` (L = num_hidden_layers) with ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and copies of the embedding and LM head, in a second safetensors file.
    Returns (transformers' model without the MTP layer, the MTP layer's tensors by their name after the prefix)."""
    import transformers
    from safetensors.torch import save_file

    hf = make_deepseek_checkpoint(path, smollm_llm, "v3-q-lora")
    c, L = hf.config, hf.config.num_hidden_layers
    torch.manual_seed(1)
    donor = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**c.to_dict(),
                                                                              "num_hidden_layers": L + 1}))
    layer = donor.model.layers[L]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    mtp = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    h = c.hidden_size
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{norm}.weight"] = 1 + 0.1 * torch.randn(h)
    mtp["eh_proj.weight"] = 0.08 * torch.randn(h, 2 * h)
    mtp["embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    mtp["shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    save_file({f"model.layers.{L}.{k}": v.contiguous() for k, v in mtp.items()},
              str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return hf, mtp


def make_tiny_checkpoint(path, smollm_llm, kind: str):
    """"dense-gqa" (a tiny Llama) or one of CONFIGS (a tiny DeepSeek) at ``path``."""
    if kind == "dense-gqa":
        return make_llama_checkpoint(path, smollm_llm)
    return make_deepseek_checkpoint(path, smollm_llm, kind)


def _quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's format, written independently of the loader: per (block x block) tile, scale = amax / 448."""
    rows, cols = w.shape
    pad = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    pad[:rows, :cols] = w
    tiles = pad.view(pad.shape[0] // block, block, pad.shape[1] // block, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [row tiles, col tiles]
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).view(pad.shape)[:rows, :cols]
    return q.view(pad.shape)[:rows, :cols].contiguous(), scale, deq.contiguous()


def write_fp8_copies(src, tmp_path, tokenizer, block: int):
    """From checkpoint ``src``: ``tmp_path/fp8`` with every 2-D projection block-quantized (DeepSeek-V3's format:
    ``weight_scale_inv`` per block x block tile) and ``tmp_path/deq`` with the same weights dequantized."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(next(src.glob("*.safetensors"))))
    fp8, dequantized = {}, {}
    for name, w in tensors.items():
        if w.dim() == 2 and name.endswith("_proj.weight"):
            q, scale, deq = _quantize_blocks(w.float(), block)
            fp8[name], fp8[name + "_scale_inv"], dequantized[name] = q, scale, deq
        else:
            fp8[name] = dequantized[name] = w
    assert any(t.dtype == torch.float8_e4m3fn for t in fp8.values())
    config = json.loads((src / "config.json").read_text())
    for target, weights, quant in ((tmp_path / "fp8", fp8, True), (tmp_path / "deq", dequantized, False)):
        target.mkdir()
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(config)
        if quant:
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [block, block]}
        (target / "config.json").write_text(json.dumps(cfg))
        tokenizer.save_pretrained(target)
    return tmp_path / "fp8", tmp_path / "deq"
