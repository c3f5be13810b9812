"""``tokenmill plan`` presets: the config.json fields that size each model (its checkpoint's own values; fields that
change no byte, such as RoPE scaling or token ids, are left out). Each is read by ``ModelConfig.from_hf`` like any
checkpoint's config."""

from __future__ import annotations

from typing import Any

_QWEN3 = {"vocab_size": 151936, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "max_position_embeddings": 40960, "tie_word_embeddings": False}
_GPT_OSS = {"architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
            "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "experts_per_token": 4, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
            "rope_theta": 150000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "swiglu_limit": 7.0}
_DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "q_lora_rank": 1536, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_shared_experts": 1,
                "num_experts_per_tok": 8, "moe_layer_freq": 1, "tie_word_embeddings": False}


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                   "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "tie_word_embeddings": False},
    "llama-3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "tie_word_embeddings": False},
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "tie_word_embeddings": True},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], **_QWEN3, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8},
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], **_QWEN3, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": []},
    "qwen3-235b-a22b": {"architectures": ["Qwen3MoeForCausalLM"], **_QWEN3, "hidden_size": 4096,
                        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "num_key_value_heads": 4, "num_experts": 128,
                        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                        "mlp_only_layers": []},
    "glm-4.5-air": {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 4096,
                    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
                    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
                    "partial_rotary_factor": 0.5, "n_routed_experts": 128, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "use_qk_norm": False,
                    "attention_bias": True, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
                    "tie_word_embeddings": False},
    "gpt-oss-20b": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32, "layer_types": _alternating(24)},
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
                     "layer_types": _alternating(36)},
    "gemma-3-27b": {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 262208, "hidden_size": 5376,
                    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168,
                    "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0, "max_position_embeddings": 131072,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
                         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                         "first_k_dense_replace": 1, "moe_layer_freq": 1, "tie_word_embeddings": False},
    "deepseek-v3": {**_DEEPSEEK_V3, "vocab_size": 129280, "num_attention_heads": 128, "n_routed_experts": 256,
                    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4},
    # DeepSeek Sparse Attention: V3's shapes plus an indexer key (128 features) per token and layer.
    "deepseek-v3.2": {**_DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"], "vocab_size": 129280,
                      "num_attention_heads": 128, "n_routed_experts": 256, "first_k_dense_replace": 3, "n_group": 8,
                      "topk_group": 4, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
    "glm-5": {"architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 154880, "hidden_size": 6144,
              "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
              "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
              "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256, "n_shared_experts": 1,
              "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1,
              "routed_scaling_factor": 2.5, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
              "max_position_embeddings": 202752, "tie_word_embeddings": False},
    # Kimi-K2: DeepSeek-V3's architecture with 384 experts, one expert group, 64 heads.
    "kimi-k2": {**_DEEPSEEK_V3, "vocab_size": 163840, "num_attention_heads": 64, "n_routed_experts": 384,
                "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827},
}
