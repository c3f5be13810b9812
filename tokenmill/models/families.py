"""Per-family details of GQA decoders, read from an HF config (pure Python: ``tokenmill plan`` imports it).

Everything a family changes about the Llama block lives in one ``BlockStyle`` (which layers slide, q/k norms,
sinks, soft-caps, norm layout, activation) and, for the MoE families, in the router and expert fields of
``MoEConfig`` (models/config.py). ``block_style`` raises a ValueError naming the field for a setting tokenmill
does not implement, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Families whose every block is a Llama-style GQA block (models/llama.py); the value: what the family adds.
GQA_FAMILIES = {
    "LlamaForCausalLM": "Llama 2/3 and SmolLM",
    "MistralForCausalLM": "sliding_window on every layer when set",
    "Qwen2ForCausalLM": "q/k/v biases; use_sliding_window from max_window_layers on",
    "Qwen3ForCausalLM": "per-head q/k RMSNorm, explicit head_dim",
    "Qwen3MoeForCausalLM": "Qwen3 attention, softmax top-k experts (norm_topk_prob, decoder_sparse_step, "
                           "mlp_only_layers)",
    "Glm4MoeForCausalLM": "partial rotary, optional q/k norm, sigmoid + correction-bias group top-k experts, "
                          "shared experts, dense first layers",
    "GptOssForCausalLM": "attention sinks, alternating sliding/full layers, top-k-then-softmax router with bias, "
                         "clamped SwiGLU experts with biases, MXFP4 experts",
    "Gemma2ForCausalLM": "(1 + w) RMSNorm, four norms per block, scaled embeddings, GELU-tanh, alternating "
                         "sliding/full layers, attention and final logit soft-capping",
    "Gemma3ForCausalLM": "Gemma 2's block with q/k norm, local/global layers with their own RoPE, final logit "
                         "soft-capping",
    "Gemma3ForConditionalGeneration": "its text model (Gemma3ForCausalLM); the vision tower is not served",
}


@dataclass(frozen=True)
class BlockStyle:
    # Per layer: its sliding window in tokens (0: full attention).
    layer_windows: tuple[int, ...] = ()
    qk_norm: bool = False
    attention_sinks: bool = False
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    query_scale: float | None = None  # None: head_dim ** -0.5
    o_proj_bias: bool = False
    # Gemma: RMSNorm scales by (1 + w), a norm after attention and after the MLP too, embeddings times sqrt(hidden).
    gemma_norms: bool = False
    hidden_act: str = "silu"
    # RoPE of the sliding layers where it differs from the full layers' (Gemma 3's local base).
    local_rope: dict[str, Any] | None = None

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0


# The special tokens that end a response in each family's chat template, served as EOS when the tokenizer has them
# (beside every EOS of config.json and generation_config.json): a checkpoint without a generation config still stops
# where its template ends a turn, and a tool call (gpt-oss's <|call|>, GLM's <|observation|>) ends the response.
TEMPLATE_STOP_TOKENS: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": ("<|eot_id|>", "<|eom_id|>"),
    "Qwen2ForCausalLM": ("<|im_end|>", "<|endoftext|>"),
    "Qwen3ForCausalLM": ("<|im_end|>", "<|endoftext|>"),
    "Qwen3MoeForCausalLM": ("<|im_end|>", "<|endoftext|>"),
    "Glm4MoeForCausalLM": ("<|endoftext|>", "<|user|>", "<|observation|>"),
    "GptOssForCausalLM": ("<|return|>", "<|call|>", "<|endoftext|>"),
    "Gemma2ForCausalLM": ("<end_of_turn>", "<eos>"),
    "Gemma3ForCausalLM": ("<end_of_turn>", "<eos>"),
    "Gemma3ForConditionalGeneration": ("<end_of_turn>", "<eos>"),
    "DeepseekV3ForCausalLM": ("<｜end▁of▁sentence｜>", "<|im_end|>"),  # DeepSeek-V3; Kimi-K2's template
    "DeepseekV32ForCausalLM": ("<｜end▁of▁sentence｜>",),
    "GlmMoeDsaForCausalLM": ("<|endoftext|>", "<|user|>", "<|observation|>"),  # GLM-5, GLM-4.5's template tokens
}


def _rope(params: dict[str, Any], field: str) -> dict[str, Any]:
    params = dict(params)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{field} rope_type {params['rope_type']!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return params


def rope_parameters(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the full layers' RoPE, the sliding layers' where it differs) from ``rope_parameters`` (transformers 5; per
    layer type for Gemma 3) or ``rope_scaling`` + ``rope_theta`` (older configs); ``partial_rotary_factor`` kept."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local = None
    if "full_attention" in params:  # per layer type
        local = _rope(params.get("sliding_attention") or params["full_attention"], "rope_parameters.sliding_attention")
        local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10000.0))
        params = dict(params["full_attention"])
    params = _rope(params, "rope_parameters" if hf.get("rope_parameters") else "rope_scaling")
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in hf:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if local is not None and "partial_rotary_factor" in params:
        local.setdefault("partial_rotary_factor", params["partial_rotary_factor"])
    return params, (local if local != params else None)


def _layer_windows(hf: dict[str, Any], architecture: str) -> tuple[int, ...]:
    layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if architecture == "Qwen2ForCausalLM" or architecture.startswith("Qwen3"):
        if not hf.get("use_sliding_window"):
            return ()
    if not window:
        return ()
    types = hf.get("layer_types")
    if types is None:
        if architecture == "MistralForCausalLM":
            types = ["sliding_attention"] * layers
        elif architecture.startswith("Qwen"):
            first = hf.get("max_window_layers", layers)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        elif architecture == "Gemma2ForCausalLM":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif architecture.startswith("Gemma3"):
            pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        else:
            types = ["sliding_attention"] * layers
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (supported: sliding_attention, full_attention)")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def block_style(hf: dict[str, Any], architecture: str) -> BlockStyle:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    gemma = architecture.startswith(("Gemma2", "Gemma3"))
    if gemma and hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a causal decoder only)")
    if architecture not in GQA_FAMILIES:  # DeepSeek's MLA (models/deepseek.py): the Llama defaults
        return BlockStyle(hidden_act=act)
    return BlockStyle(
        layer_windows=_layer_windows(hf, architecture),
        qk_norm=architecture.startswith(("Qwen3", "Gemma3")) or bool(hf.get("use_qk_norm")),
        attention_sinks=architecture == "GptOssForCausalLM",
        # Gemma 3 configs carry attn_logit_softcapping, but its attention (transformers') never applies it.
        attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0) if architecture == "Gemma2ForCausalLM" else 0.0,
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        query_scale=hf["query_pre_attn_scalar"] ** -0.5 if gemma and hf.get("query_pre_attn_scalar") else None,
        # Llama, Qwen3, gpt-oss and Gemma 3 give o_proj the attention bias; Mistral, Qwen2 and GLM do not.
        o_proj_bias=bool(hf.get("attention_bias")) and architecture not in (
            "MistralForCausalLM", "Qwen2ForCausalLM", "Glm4MoeForCausalLM"),
        gemma_norms=gemma, hidden_act=act, local_rope=rope_parameters(hf)[1])


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's language model config (Gemma3ForConditionalGeneration: ``text_config``), keeping the
    wrapper's architectures and generation fields; any other config as it is."""
    if "text_config" not in hf or not any(a.endswith("ForConditionalGeneration") for a in hf.get("architectures", [])):
        return hf
    text = dict(hf["text_config"])
    text["architectures"] = hf["architectures"]
    for key in ("eos_token_id", "quantization_config", "tie_word_embeddings"):
        if key in hf and key not in text:
            text[key] = hf[key]
    return text
