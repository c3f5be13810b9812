"""DeepSeek-V2/V3 family: MLA attention over a latent-only paged cache, MoE FFN after the first dense layers."""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.kernels.attention_op import attention_context
from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.fp8 import dequantize_fp8_blocks
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheDtype, KVCacheSpec
from tokenmill.models.base import DecoderLM
from tokenmill.models.config import ModelConfig
from tokenmill.models.layers.mla import MLAttention
from tokenmill.models.layers.mlp import SwiGLU
from tokenmill.models.layers.moe import MoE
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding

# Kept float32 whatever the compute dtype: the router decides in float32, as DeepSeek's code does; fp8 scales.
_FP32_PARAMS = ("gate_weight", "e_score_correction_bias", "w_gate_up_scale", "w_down_scale")


# The routed experts' weights in the released per-expert layout (the one fp8 checkpoints use).
_ROUTED_EXPERT_WEIGHT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


class DeepseekLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int, rotary: RotaryEmbedding, fp8_block: tuple[int, int] | None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAttention(c, rotary, index)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        moe = c.moe is not None and c.moe.is_moe_layer(index)
        self.mlp = MoE(c.hidden_size, c.moe, fp8_block) if moe else SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, positions):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekMTP(nn.Module):
    """DeepSeek-V3's multi-token-prediction module, a draft model inside the checkpoint (layer ``num_layers``): at
    position i it reads the main model's final hidden state h_i and the embedding of token i+1, and its output,
    through ``norm`` and the main model's LM head, predicts token i+2. It shares the embedding and the LM head with the
    main model (the checkpoint's copies of them are the same tensors), and its attention has a cache layer of its
    own, after the decoder layers'. As vLLM and SGLang run it: [enorm(embedding) | hnorm(h)] in that order, the
    embedding zeroed at position 0, and its own output (before ``norm``) fed back as h for a further draft."""

    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, fp8_block: tuple[int, int] | None):
        super().__init__()
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.block = DeepseekLayer(c, c.num_layers, rotary, fp8_block)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # the checkpoint's shared_head.norm

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """embeds [T, H] (of the token after each position), positions [T], previous [T, H] -> [T, H]."""
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        return self.block(x, positions)


class DeepseekForCausalLM(DecoderLM):
    fp32_params = _FP32_PARAMS
    compilable = False  # the MoE routes tokens with data-dependent shapes (per-expert token lists): eager for now

    def __init__(self, config: ModelConfig, kernels: KernelChoice = KernelChoice(), mtp: bool = False):
        super().__init__()
        c = self.config = config
        self.weight_block = c.fp8_weight_block or (128, 128)
        # fp8 checkpoints keep their routed experts fp8 where fp8 GEMMs exist (the Triton fused MoE), with
        # activations quantized per token group as DeepSeek's own inference does; elsewhere they are dequantized at
        # load. The fused gate/up scale grid needs the gate/up boundary on a block edge.
        self.fp8_experts = c.fp8_weight_block is not None and kernels.backend == "triton" and c.moe is not None \
            and c.moe.intermediate_size % self.weight_block[0] == 0
        fp8_block = self.weight_block if self.fp8_experts else None
        self.rotary = RotaryEmbedding(c.mla.qk_rope_head_dim, c.max_position, c.rope)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DeepseekLayer(c, i, self.rotary, fp8_block) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if mtp and not c.num_mtp_layers:
            raise ValueError("the checkpoint has no multi-token-prediction layer (num_nextn_predict_layers)")
        self.mtp = DeepseekMTP(c, self.rotary, fp8_block) if mtp else None
        self.requires_grad_(False)
        self.use_kernels(kernels)

    def kv_cache_spec(self, dtype: KVCacheDtype, block_size: int) -> KVCacheSpec:
        """The decoder layers' latent cache, plus one layer for the MTP module when it drafts."""
        spec = self.config.kv_cache_spec(dtype, block_size)
        return dataclasses.replace(spec, num_layers=spec.num_layers + 1) if self.mtp is not None else spec

    # --- multi-token prediction (drafts; speculative/mtp.py drives it)
    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
                    meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """The MTP module over a flattened batch laid out by ``meta``: the token after each position [T],
        positions [T], the hidden state it continues [T, H] -> its output [T, H] (writes its cache layer)."""
        with attention_context(meta, kv_cache.data, kv_cache.scales):
            return self.mtp(self.embed_tokens(next_ids), positions, previous)

    def mtp_greedy(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] outputs of the MTP module -> [S] its most likely tokens."""
        return self.compute_logits(self.mtp.norm(mtp_hidden)).argmax(dim=-1)

    # --- weights
    def _mtp_name(self, name: str) -> str | None:
        """A checkpoint name of the first MTP layer -> the MTP module's; None for weights this model skips: further
        MTP layers, the MTP layer when not drafting, and its copies of the embedding and LM head (shared)."""
        m = re.fullmatch(r"(?:model\.)?layers\.(\d+)\.(.+)", name)
        if self.mtp is None or int(m.group(1)) != self.config.num_layers:
            return None
        rest = m.group(2)
        if rest.startswith("embed_tokens.") or rest.startswith("shared_head.head."):
            return None
        if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            return f"mtp.{rest}"
        if rest.startswith("shared_head.norm."):
            return f"mtp.norm.{rest.removeprefix('shared_head.norm.')}"
        return f"mtp.block.{rest}"

    def _target(self, name: str, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor, str]:
        """HF name -> (destination view, canonical parameter name). Handles dense, per-expert and fused layouts."""
        n = name.removeprefix("model.")
        inter = self.config.moe.intermediate_size if self.config.moe else 0
        if m := re.fullmatch(r"(.+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight", n):
            prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
            if kind == "down":
                return params[f"{prefix}.w_down"].data[expert], f"{prefix}.w_down"
            rows = slice(0, inter) if kind == "gate" else slice(inter, 2 * inter)
            return params[f"{prefix}.w_gate_up"].data[expert, rows], f"{prefix}.w_gate_up"
        if m := re.fullmatch(r"(.+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight_scale_inv", n):
            prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
            if kind == "down":
                return params[f"{prefix}.w_down_scale"].data[expert], f"{prefix}.w_down_scale"
            rows = inter // self.weight_block[0]  # whole blocks: fp8_experts requires it
            rows = slice(0, rows) if kind == "gate" else slice(rows, 2 * rows)
            return params[f"{prefix}.w_gate_up_scale"].data[expert, rows], f"{prefix}.w_gate_up_scale"
        n = re.sub(r"mlp\.experts\.gate_up_proj$", "mlp.w_gate_up", n)
        n = re.sub(r"mlp\.experts\.down_proj$", "mlp.w_down", n)
        n = re.sub(r"mlp\.gate\.weight$", "mlp.gate_weight", n)
        n = re.sub(r"mlp\.gate\.e_score_correction_bias$", "mlp.e_score_correction_bias", n)
        if m := re.fullmatch(r"(.*mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight", n):
            full = params[f"{m.group(1)}.gate_up_proj.weight"].data
            half = full.shape[0] // 2
            return (full[:half] if m.group(2) == "gate" else full[half:]), f"{m.group(1)}.gate_up_proj.weight"
        if n not in params:
            raise ValueError(f"unexpected weight {name!r} for DeepseekForCausalLM")
        return params[n].data, n

    def _dequantized(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """fp8 block-quantized checkpoints (DeepSeek-V3 style): each float8_e4m3fn ``W`` comes with
        ``W_scale_inv`` [ceil(out / bo), ceil(in / bi)] and means ``W * scale_inv`` per (bo x bi) block. The CPU
        path dequantizes here (so does every path for the weights outside the routed experts, and for the experts
        unless ``fp8_experts``); tensors arrive in any order, so halves wait for each other."""
        pending: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            is_scale = name.endswith(".weight_scale_inv")
            if not is_scale and tensor.dtype != torch.float8_e4m3fn:
                yield name, tensor
                continue
            base = name.removesuffix("_scale_inv")
            other = pending.pop(base + ("" if is_scale else "_scale_inv"), None)
            if other is None:
                pending[name] = tensor
                continue
            weight, scale = (other, tensor) if is_scale else (tensor, other)
            if self.fp8_experts and _ROUTED_EXPERT_WEIGHT.search(base):
                yield base, weight
                yield base + "_scale_inv", scale
            else:
                yield base, dequantize_fp8_blocks(weight, scale, self.weight_block)
        if pending:
            raise ValueError(f"fp8 weights without their scales (or scales without weights): {sorted(pending)[:3]}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        layers = self.config.num_layers
        for name, tensor in self._dequantized(weights):
            if (m := re.search(r"layers\.(\d+)\.", name)) and int(m.group(1)) >= layers:
                name = self._mtp_name(name)  # a multi-token-prediction layer
                if name is None:
                    continue
            dst, canonical = self._target(name, params)
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled[canonical] = filled.get(canonical, 0) + tensor.numel()
        self.finish_loading(filled, self.config.tie_word_embeddings)
