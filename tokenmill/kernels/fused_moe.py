"""Mixture-of-experts FFN: route each token to top-k experts, run SwiGLU experts, sum the weighted outputs.

Shapes: ``x[T, H]``; ``w_gate_up[E, 2I, H]`` (rows: gate then up, as HF stores fused experts);
``w_down[E, H, I]``; ``topk_weights[T, k]`` float32 and ``topk_ids[T, k]`` int64 from the router.
Output ``[T, H]`` in x's dtype: ``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
``e = topk_ids[t, j]``. Experts that get no tokens cost nothing.

gpt-oss's experts (``ExpertActivation``): biases on both projections and a clamped SwiGLU,
``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=L)``; the reference runs them on every
backend (the Triton kernel's epilogue has neither).

fp8 experts (DeepSeek-V3): both weights float8_e4m3fn with ``Fp8BlockScales`` (kernels/fp8.py has the format);
the activations entering each GEMM (x, and the SiLU-and-mul output) are quantized per token and per group of
``block[1]`` features, so the whole expert runs as fp8 x fp8 products with float32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels.fp8 import dequantize_fp8_blocks, per_token_group_quant_fp8_reference


@dataclass(frozen=True)
class Fp8BlockScales:
    """Scales of fp8 expert weights: ``w ~= float(w_q) * scale[e, n // bn, k // bk]``."""
    gate_up: torch.Tensor  # [E, ceil(2I / bn), ceil(H / bk)] float32
    down: torch.Tensor  # [E, ceil(H / bn), ceil(I / bk)] float32
    block: tuple[int, int]  # (bn, bk), 128 x 128 in DeepSeek-V3


@dataclass(frozen=True)
class ExpertActivation:
    kind: str  # "swiglu_oai"
    alpha: float
    limit: float
    gate_up_bias: torch.Tensor  # [E, 2I]
    down_bias: torch.Tensor  # [E, H]

    def gated(self, gate_up: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = (gate_up + self.gate_up_bias[expert]).chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def _fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the fp8 GEMMs see it: quantized per (token, group) and dequantized, float32."""
    q, scale = per_token_group_quant_fp8_reference(x, group)
    return q.float() * scale.repeat_interleave(group, 1)[:, :x.shape[1]]


def fused_moe_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        fp8_scales: Fp8BlockScales | None = None,
                        activation: ExpertActivation | None = None) -> torch.Tensor:
    """The spec (and the CPU path): a readable loop over the experts that received tokens."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    intermediate = w_down.shape[-1]
    for expert in topk_ids.unique().tolist():
        if expert >= w_gate_up.shape[0]:
            continue  # another rank's expert
        token_idx, slot = (topk_ids == expert).nonzero(as_tuple=True)
        if activation is not None:
            hidden = activation.gated(F.linear(x[token_idx], w_gate_up[expert]), expert)
            y = F.linear(hidden, w_down[expert], activation.down_bias[expert])
        elif fp8_scales is None:
            gate, up = F.linear(x[token_idx], w_gate_up[expert]).split(intermediate, dim=-1)
            y = F.linear(F.silu(gate) * up, w_down[expert])
        else:
            group = fp8_scales.block[1]
            w1 = dequantize_fp8_blocks(w_gate_up[expert], fp8_scales.gate_up[expert], fp8_scales.block)
            w2 = dequantize_fp8_blocks(w_down[expert], fp8_scales.down[expert], fp8_scales.block)
            gate, up = F.linear(_fake_quant(x[token_idx], group), w1).split(intermediate, dim=-1)
            y = F.linear(_fake_quant((F.silu(gate) * up).to(x.dtype), group), w2)
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
    return out.to(x.dtype)


@dataclass(frozen=True)
class AlignedRouting:
    """The (token, choice) pairs sorted by expert, each expert's run padded to a multiple of ``block_m``, so that
    every ``block_m`` rows of ``sorted_ids`` belong to one expert (one GEMM tile of one weight matrix).

    Computed without a device-to-host sync: the buffers have their worst-case size
    (T*k + (E+1)*(block_m - 1) rows); tiles past the end have expert -1 and are skipped by the kernel, and so are the
    tiles of pairs whose id is E (another rank's expert), sorted last.
    """
    sorted_ids: torch.Tensor  # [max_rows] int32: flat pair index t * k + j, or T * k (padding)
    expert_ids: torch.Tensor  # [max_rows / block_m] int32: the expert of each tile, -1 past the end
    block_m: int
    num_pairs: int  # T * k


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    flat = topk_ids.flatten().to(torch.int64)
    pairs = flat.numel()
    # scatter_add, not bincount: bincount sizes its output from the data (a device-to-host sync on CUDA). Bucket E
    # holds the pairs of other ranks' experts.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank_in_expert = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of_sorted]
    max_rows = pairs + (num_experts + 1) * (block_m - 1)
    max_rows = (max_rows + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((max_rows,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[(padded_end - padded)[expert_of_sorted] + rank_in_expert] = order.to(torch.int32)
    tile_start = torch.arange(0, max_rows, block_m, device=flat.device)
    expert_ids = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return AlignedRouting(sorted_ids, expert_ids, block_m, pairs)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, fp8_scales: Fp8BlockScales | None = None, backend: str = "torch",
              tuner=None, activation: ExpertActivation | None = None) -> torch.Tensor:
    """Dispatch: ``backend`` is a resolved kernel backend, "triton" or "torch" (kernels/backend.py); ``tuner`` an
    optional ``kernels.triton.moe_config.MoETuner`` (measured launch configs) for the Triton path."""
    if backend == "triton" and activation is None:
        from tokenmill.kernels.triton.fused_moe import fused_moe_triton

        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, fp8_scales, tuner=tuner)
    return fused_moe_reference(x, w_gate_up, w_down, topk_weights, topk_ids, fp8_scales, activation)
