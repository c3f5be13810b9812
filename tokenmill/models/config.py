"""ModelConfig: the one normalization of a checkpoint's config (HF config.json, GGUF metadata turned into one).

Every consumer -- the model classes, the KV-cache spec, the engine's stop checks, ``tokenmill plan`` -- reads this
object, never the raw dict, so the defaults HF configs leave implicit (head_dim, KV heads, Qwen2's biases, V3's
router) are decided once. Pure Python: ``tokenmill plan`` imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from tokenmill.kvcache.spec import KVCacheDtype, KVCacheSpec
from tokenmill.models.families import GQA_FAMILIES, BlockStyle, block_style, rope_parameters, text_config
from tokenmill.models.quant_methods import CHECKPOINT_METHODS, is_quantized_module, linear_format


# What models/registry.py serves; a checkpoint naming several architectures is read as the first of these.
# DeepSeek Sparse Attention: V3's MLA with a lightning indexer per layer (models/layers/dsa.py).
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
KNOWN_ARCHITECTURES = (*GQA_FAMILIES, "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", *DSA_ARCHITECTURES)


def tp_split(n: int, tp: int, what: str) -> int:
    """``n`` (heads, experts, a width) shared evenly by ``tp`` ranks; a ValueError naming ``what`` if it cannot be."""
    if n % tp:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {tp}")
    return n // tp


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: what the latent cache holds and how heads expand from it."""
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved_rope: bool  # V2 always rotates interleaved pairs; V3 configs say so (rope_interleave)


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention: each query keeps the ``index_topk`` cached tokens its layer's indexer scores
    highest. ``layer_types[i]``: "full" (layer i runs its own indexer and caches its key) or "shared" (GLM-5: it
    reuses the selection of the last full layer before it)."""
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    layer_types: tuple[str, ...]
    interleaved_rope: bool  # GLM-5's indexer rotates interleaved pairs; DeepSeek-V3.2's the two halves


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int
    layer_freq: int
    scoring: str  # "softmax" | "sigmoid" | "topk_softmax" (gpt-oss: the top-k logits, then their softmax)
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    num_groups: int
    topk_groups: int
    normalize: bool
    scaling: float
    # Qwen3-MoE's placement: layers whose index + 1 is a multiple of sparse_step, except mlp_only_layers.
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_bias: bool = False  # gpt-oss: the router's logits have a bias
    # "silu": down(silu(gate) * up); "swiglu_oai" (gpt-oss): gate and up clamped at swiglu_limit,
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate), and biases on both expert projections.
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @property
    def expert_bias(self) -> bool:
        return self.activation == "swiglu_oai"

    def is_moe_layer(self, index: int) -> bool:
        """DeepSeek's rule (transformers drops the frequency, which every released config sets to 1) and
        Qwen3-MoE's (sparse step, MLP-only layers)."""
        return index >= self.first_k_dense_replace and index % self.layer_freq == 0 \
            and (index + 1) % self.sparse_step == 0 and index not in self.mlp_only_layers


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantized linear weights (kernels/quant_linear.py names the formats)."""
    method: str  # "gguf" (per tensor, as the file stores it) | "awq" | "gptq" | "compressed-tensors"
    # GGUF: (module name as the checkpoint names it, e.g. model.layers.0.self_attn.q_proj, format) per quantized
    # tensor; a name absent is full precision.
    formats: tuple[tuple[str, str], ...] = ()
    # The other methods: one format for every quantized linear layer, and the config that says which those are.
    default_format: str | None = None
    config: dict[str, Any] = field(default_factory=dict, compare=False)

    def format_of(self, module: str) -> str | None:
        """The format of checkpoint linear layer ``module``; None: stored full precision."""
        if self.formats:
            return dict(self.formats).get(module)
        return self.default_format if is_quantized_module(self.config, module) else None


# quant_method values read from a checkpoint's config.json (fp8: DeepSeek-V3's 128x128 blocks).
SUPPORTED_QUANT_METHODS = ("fp8", "gguf", *CHECKPOINT_METHODS)
FP8_BLOCK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", *DSA_ARCHITECTURES)


def _quantization(hf: dict[str, Any], architecture: str) -> "Quantization | None":
    quant = hf.get("quantization_config") or {}
    method = quant.get("quant_method")
    if not quant or method == "fp8":
        if method == "fp8" and architecture not in FP8_BLOCK_ARCHITECTURES:
            raise ValueError(f"quantization fp8 (block-quantized weights with *_scale_inv tensors) is supported for "
                             f"{', '.join(FP8_BLOCK_ARCHITECTURES)} checkpoints, not {architecture}")
        return None
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_QUANT_METHODS)})")
    if method in CHECKPOINT_METHODS:
        return Quantization(method, default_format=linear_format(quant)[1], config=dict(quant))
    return Quantization(method, tuple(sorted(quant.get("formats", {}).items())))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # GQA/MHA: K/V heads; MLA: equal to num_heads (heads expand from one latent)
    head_dim: int  # GQA/MHA head size; MLA: qk_nope + qk_rope
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope: dict[str, Any]
    # Every id that ends generation: config.json's, generation_config.json's and the tokenizer's EOS, in that order.
    eos_token_ids: tuple[int, ...] = ()
    mla: MLAConfig | None = None
    dsa: DSAConfig | None = None  # MLA with a lightning indexer (DeepSeek-V3.2, GLM-5)
    moe: MoEConfig | None = None
    # fp8 block quantization (DeepSeek-V3's format): the (rows, cols) block of one weight scale; None = unquantized.
    fp8_weight_block: tuple[int, int] | None = None
    # DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers), stored after the decoder layers.
    num_mtp_layers: int = 0
    # Linear weights stored quantized (a GGUF file's Q4/Q8 tensors); None: full precision (or fp8 blocks, above).
    quantization: Quantization | None = None
    # What the family changes about a Llama block (models/families.py): windows, q/k norms, sinks, soft-caps, norms.
    style: BlockStyle = BlockStyle()

    @property
    def rotary_dim(self) -> int:
        """How many features of a head RoPE rotates (GLM's partial_rotary_factor)."""
        return int(self.head_dim * self.rope.get("partial_rotary_factor", 1.0))

    @property
    def attention_kind(self) -> str:
        if self.mla:
            return "MLA"
        return "MHA" if self.num_kv_heads == self.num_heads else "GQA"

    def kv_cache_spec(self, dtype: KVCacheDtype, block_size: int, tp: int = 1) -> KVCacheSpec:
        """One of ``tp`` tensor-parallel ranks' layout. MLA: one slot per token and layer holding the latent and the
        roped key, nothing per head (every rank holds it whole); GQA/MHA: K and V per local KV head."""
        if self.mla:  # DSA: the indexer's key beside the latent, one slot per token (the same block table)
            index_dim = self.dsa.index_head_dim if self.dsa else 0
            return KVCacheSpec(self.num_layers, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim + index_dim,
                               dtype, block_size)
        return KVCacheSpec.for_gqa(self.num_layers, self.local_kv_heads(tp), self.head_dim, dtype, block_size,
                                   self.style.layer_windows)

    def local_kv_heads(self, tp: int) -> int:
        """KV heads one of ``tp`` ranks holds: split when there are at least tp, else one (each replicated on
        tp / kv_heads ranks, the ones whose query heads read it)."""
        if self.num_kv_heads >= tp:
            return tp_split(self.num_kv_heads, tp, "KV heads")
        if tp % self.num_kv_heads:
            raise ValueError(f"the tensor-parallel size {tp} is not a multiple of the KV heads ({self.num_kv_heads})")
        return 1

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation_config: dict[str, Any] | None = None,
                tokenizer_eos_token_id: int | None = None, template_stop_ids: Sequence[int] = ()) -> "ModelConfig":
        """``template_stop_ids``: the tokenizer's ids of the family's TEMPLATE_STOP_TOKENS (models/families.py)."""
        hf = text_config(hf)
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        architecture = next((a for a in archs if a in KNOWN_ARCHITECTURES), archs[0])
        if architecture not in KNOWN_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r} (supported: "
                             f"{', '.join(sorted(KNOWN_ARCHITECTURES))})")
        heads = hf["num_attention_heads"]
        mla = _mla(hf, architecture)
        eos = _ids(hf.get("eos_token_id")) + _ids((generation_config or {}).get("eos_token_id"))
        eos += _ids(tokenizer_eos_token_id) + list(template_stop_ids)
        quant = hf.get("quantization_config") or {}
        # MXFP4 experts (gpt-oss) are recognized by their tensors and dequantized at load (models/expert_weights.py).
        mxfp4 = quant.get("quant_method") == "mxfp4"
        if mxfp4 and architecture != "GptOssForCausalLM":
            raise ValueError(f"quantization mxfp4 is supported for GptOssForCausalLM experts, not {architecture}")
        quantization = None if mxfp4 else _quantization(hf, architecture)
        return cls(
            architecture=architecture, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=heads if mla else (hf.get("num_key_value_heads") or heads),
            head_dim=(mla.qk_nope_head_dim + mla.qk_rope_head_dim) if mla
            else (hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position=hf.get("max_position_embeddings", 4096 if mla else 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(hf.get("attention_bias", False)) or architecture == "Qwen2ForCausalLM",
            rope=rope_parameters(hf)[0], eos_token_ids=tuple(dict.fromkeys(eos)), mla=mla, dsa=_dsa(hf, architecture),
            moe=_moe(hf, architecture),
            fp8_weight_block=tuple(quant.get("weight_block_size") or (128, 128))
            if quant.get("quant_method") == "fp8" else None,
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0) if mla else 0, quantization=quantization,
            style=block_style(hf, architecture))


def _mla(hf: dict[str, Any], architecture: str) -> MLAConfig | None:
    if hf.get("kv_lora_rank") is None:
        return None
    return MLAConfig(kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank") or None,
                     qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                     v_head_dim=hf["v_head_dim"], interleaved_rope=bool(hf.get("rope_interleave", True)))


def _dsa(hf: dict[str, Any], architecture: str) -> DSAConfig | None:
    if architecture not in DSA_ARCHITECTURES:
        return None
    layers = hf["num_hidden_layers"]
    types = hf.get("indexer_types")
    if types is None and (pattern := hf.get("index_topk_pattern")) is not None:  # GLM-5's "FSS..." form
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:  # every index_topk_freq-th layer from index_skip_topk_offset runs its own indexer
        freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(types) != layers or set(types) - {"full", "shared"} or types[0] != "full":
        raise ValueError(f"indexer_types must give 'full' or 'shared' for each of the {layers} layers, the first "
                         f"'full': {types}")
    if not hf.get("q_lora_rank"):
        raise ValueError("a DSA indexer reads the query's low-rank latent: q_lora_rank is required")
    return DSAConfig(index_topk=hf.get("index_topk", 2048), index_head_dim=hf.get("index_head_dim", 128),
                     index_n_heads=hf.get("index_n_heads", 32 if architecture == "GlmMoeDsaForCausalLM" else 64),
                     layer_types=tuple(types),
                     interleaved_rope=architecture == "GlmMoeDsaForCausalLM")


def _moe(hf: dict[str, Any], architecture: str) -> MoEConfig | None:
    if architecture in ("Qwen3MoeForCausalLM", "GptOssForCausalLM"):
        return _softmax_moe(hf, architecture)
    if not hf.get("n_routed_experts"):
        return None
    # Released configs name both; transformers 5 drops them for V3 and GLM-4.5, whose routers are sigmoid + noaux_tc.
    sigmoid = architecture in ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", *DSA_ARCHITECTURES)
    scoring = hf.get("scoring_func") or ("sigmoid" if sigmoid else "softmax")
    method = hf.get("topk_method") or ("noaux_tc" if scoring == "sigmoid" else "greedy")
    return MoEConfig(num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                     intermediate_size=hf["moe_intermediate_size"], num_shared_experts=hf.get("n_shared_experts") or 0,
                     first_k_dense_replace=hf.get("first_k_dense_replace", 0), layer_freq=hf.get("moe_layer_freq", 1),
                     scoring=scoring, topk_method=method, num_groups=hf.get("n_group") or 1,
                     topk_groups=hf.get("topk_group") or 1, normalize=bool(hf.get("norm_topk_prob", False)),
                     scaling=float(hf.get("routed_scaling_factor", 1.0)))


def _softmax_moe(hf: dict[str, Any], architecture: str) -> MoEConfig:
    """Qwen3-MoE (softmax over all experts, top-k, optionally renormalized) and gpt-oss (top-k of the biased logits,
    softmax over those k): no shared experts, no groups."""
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    gpt_oss = architecture == "GptOssForCausalLM"
    return MoEConfig(num_experts=experts, top_k=hf["num_experts_per_tok"],
                     intermediate_size=hf["intermediate_size"] if gpt_oss else hf["moe_intermediate_size"],
                     num_shared_experts=0, first_k_dense_replace=0, layer_freq=1,
                     scoring="topk_softmax" if gpt_oss else "softmax", topk_method="greedy", num_groups=1,
                     topk_groups=1, normalize=bool(hf.get("norm_topk_prob", False)), scaling=1.0,
                     sparse_step=hf.get("decoder_sparse_step") or 1,
                     mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()), router_bias=gpt_oss,
                     activation="swiglu_oai" if gpt_oss else "silu", swiglu_alpha=hf.get("swiglu_alpha", 1.702),
                     swiglu_limit=hf.get("swiglu_limit", 7.0))
