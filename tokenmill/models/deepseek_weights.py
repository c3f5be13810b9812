"""Loading DeepSeek checkpoints: HF names -> parameters (dense, per-expert and fused expert layouts, the MTP layer),
fp8 block-quantized weights, and each tensor-parallel rank's slice of every tensor (``weight_shard``)."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.kernels.fp8 import dequantize_fp8_blocks
from tokenmill.models.base import mlp_sources
from tokenmill.models.loader import SKIP

# The routed experts' weights in the released per-expert layout (the one fp8 checkpoints use).
_ROUTED_EXPERT_WEIGHT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# A dense MLP's or the shared experts' gate or up weight: one half of the model's fused gate_up_proj.
_GATE_OR_UP = re.compile(r"(.*mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight")


class DeepseekWeights:
    """Mixed into DeepseekForCausalLM: reads its ``config``, ``tp``, ``mtp``, ``weight_block``, ``fp8_experts``."""

    @property
    def expert_offset(self) -> int:
        """Global index of this rank's first routed expert (experts split whole across ranks)."""
        moe = self.config.moe
        return self.tp.rank * (moe.num_experts // self.tp.size) if moe else 0

    def weight_shard(self, name: str):
        """The (dimension, slice) of checkpoint tensor ``name`` this rank reads, None for all of it, SKIP for none
        of it (another rank's experts; MTP weights nobody runs)."""
        c, tp = self.config, self.tp
        n = name.removeprefix("model.")
        if (m := re.match(r"layers\.(\d+)\.", n)) and int(m.group(1)) >= c.num_layers and self._mtp_name(name) is None:
            return SKIP
        if tp.size == 1:
            return None
        if n.endswith("_scale_inv"):
            return self._scale_shard(self.weight_shard(name.removesuffix("_scale_inv")))
        if m := re.search(r"mlp\.experts\.(\d+)\.", n):
            local = c.moe.num_experts // tp.size
            return None if 0 <= int(m.group(1)) - self.expert_offset < local else SKIP
        if re.search(r"mlp\.experts\.(gate_up|down)_proj$", n):
            return 0, slice(*tp.span(c.moe.num_experts))
        part, a, heads = n.split(".")[-2], c.mla, c.num_heads
        if part in ("q_b_proj", "q_proj"):
            return 0, slice(*tp.span(heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)))
        if part == "kv_b_proj":
            return 0, slice(*tp.span(heads * (a.qk_nope_head_dim + a.v_head_dim)))
        if part == "o_proj":
            return 1, slice(*tp.span(heads * a.v_head_dim))
        if part in ("gate_proj", "up_proj", "down_proj"):
            shared = "shared_experts" in n
            width = c.moe.intermediate_size * c.moe.num_shared_experts if shared else c.intermediate_size
            return int(part == "down_proj"), slice(*tp.span(width))
        if n.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.embed_tokens.shard(c.vocab_size)
        return None

    def _scale_shard(self, weight_cut):
        """The fp8 scales' slice matching a weight slice: whole blocks only."""
        if weight_cut is None or weight_cut is SKIP:
            return weight_cut
        dim, part = weight_cut
        block = self.weight_block[dim]
        if part.start % block:
            raise ValueError(f"a tensor-parallel slice starting at {part.start} cuts an fp8 block of {block}")
        return dim, slice(part.start // block, -(-part.stop // block))

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
            prefix, expert, kind = m.group(1), int(m.group(2)) - self.expert_offset, m.group(3)
            if kind == "down":
                return params[f"{prefix}.w_down"].data[expert], f"{prefix}.w_down"
            rows = slice(0, inter) if kind == "gate" else slice(inter, 2 * inter)
            return params[f"{prefix}.w_gate_up"].data[expert, rows], f"{prefix}.w_gate_up"
        if m := re.fullmatch(r"(.+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight_scale_inv", n):
            prefix, expert, kind = m.group(1), int(m.group(2)) - self.expert_offset, m.group(3)
            if kind == "down":
                return params[f"{prefix}.w_down_scale"].data[expert], f"{prefix}.w_down_scale"
            rows = inter // self.weight_block[0]  # whole blocks: fp8_experts requires it
            rows = slice(0, rows) if kind == "gate" else slice(rows, 2 * rows)
            return params[f"{prefix}.w_gate_up_scale"].data[expert, rows], f"{prefix}.w_gate_up_scale"
        n = re.sub(r"mlp\.experts\.gate_up_proj$", "mlp.w_gate_up", n)
        n = re.sub(r"mlp\.experts\.down_proj$", "mlp.w_down", n)
        n = re.sub(r"mlp\.gate\.weight$", "mlp.gate_weight", n)
        n = re.sub(r"mlp\.gate\.e_score_correction_bias$", "mlp.e_score_correction_bias", n)
        if m := _GATE_OR_UP.fullmatch(n):
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

    def linear_sources(self) -> dict[str, tuple[str, ...]]:
        """The linear layers ``--quantization int8|int4|fp8`` may round (module path -> the checkpoint modules its
        weight is made of, in row order): the decoder layers' attention projections and dense or shared-expert MLPs,
        and the LM head. Full precision stay ``kv_b_proj`` (MLA reads its weight as a tensor), DSA's indexer (it
        ranks tokens), the routed experts (kernels/fused_moe.py) and the MTP module's layer."""
        sources = {}
        for i, layer in enumerate(self.layers):
            ckpt, attn = f"model.layers.{i}", layer.self_attn
            projections = ("q_a_proj", "q_b_proj") if attn.q_lora_rank else ("q_proj",)
            for part in (*projections, "kv_a_proj_with_mqa", "o_proj"):
                sources[f"layers.{i}.self_attn.{part}"] = (f"{ckpt}.self_attn.{part}",)
            sources.update(mlp_sources(i, layer.mlp))
        sources["lm_head"] = ("model.embed_tokens",) if self.config.tie_word_embeddings else ("lm_head",)
        return sources

    def _copy_to_quantized(self, name: str, tensor: torch.Tensor, filled: dict[str, int]) -> bool:
        """A full-precision weight aimed at a layer ``--quantization`` rounds (QuantLinear): rounded into it (gate and
        up into their halves of the fused layer). False for any other tensor."""
        n = name.removeprefix("model.")
        offset = None
        if m := _GATE_OR_UP.fullmatch(n):
            n = f"{m.group(1)}.gate_up_proj.weight"
            offset = 0 if m.group(2) == "gate" else tensor.shape[0]
        return self.copy_quantized(n, offset, tensor, filled)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        layers = self.config.num_layers
        for name, tensor in self._dequantized(weights):
            if (m := re.search(r"layers\.(\d+)\.", name)) and int(m.group(1)) >= layers:
                name = self._mtp_name(name)  # a multi-token-prediction layer
                if name is None:
                    continue
            if self._copy_to_quantized(name, tensor, filled):
                continue
            dst, canonical = self._target(name, params)
            self.copy_weight(canonical, dst, tensor, filled)
        self.finish_loading(filled, self.config.tie_word_embeddings)
