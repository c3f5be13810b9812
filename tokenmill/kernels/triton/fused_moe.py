"""Triton fused MoE: two grouped GEMMs over tokens sorted by expert (spec: ``kernels.fused_moe.fused_moe_reference``).

1. ``align_routing`` sorts the T*k (token, choice) pairs by expert and pads each expert's run to BLOCK_M rows,
   so every M tile of the sorted list multiplies by one expert's weights; experts with no tokens get no tiles.
2. GEMM 1 (gate/up): rows ``x[pair // k]`` times ``w_gate_up[e]``; each program computes the gate and the up
   columns of the same N tile and stores ``silu(gate) * up`` [T*k, I]: the 2I-wide product never reaches memory.
3. GEMM 2 (down): rows of that intermediate times ``w_down[e]``, scaled by the pair's routing weight, stored
   float32 [T*k, H]; the k choices of a token are summed afterwards (float32, as the reference does).

fp8 (DeepSeek-V3): weights float8_e4m3fn with (bn x bk) block scales, activations quantized per token and group
of bk features just before each GEMM. BLOCK_K divides bk, so each K step of a tile meets one activation scale per
row and one weight scale per column: ``acc += dot(a_q, b_q) * a_scale[:, None] * b_scale[None, :]``.

Launch configurations (tile sizes, warps, stages) come from ``moe_config``: a heuristic for any shape, or
measured once per shape and kept on disk (``MoETuner``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fused_moe import AlignedRouting, Fp8BlockScales, align_routing
from tokenmill.kernels.triton.common import dot, interpreting
from tokenmill.kernels.triton.fp8_quant import per_token_group_quant_fp8_triton
from tokenmill.kernels.triton.moe_config import MoEConfig, MoEShape, MoETuner, heuristic_config


@triton.jit
def _moe_gemm_kernel(
        a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr,
        num_pairs, num_m_tiles, stride_am, stride_be, stride_bn, stride_cm, stride_as, stride_bse, stride_bsn,
        N: tl.constexpr, K: tl.constexpr, A_ROW_DIV: tl.constexpr,
        GATED: tl.constexpr, ROUTED_WEIGHT: tl.constexpr, FP8: tl.constexpr, SCALE_N: tl.constexpr,
        SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, F32: tl.constexpr):
    """C[rows, :N] = epilogue(A[rows // A_ROW_DIV] @ B[e, :N]^T) over the rows of one expert's M tile.
    GATED: B has 2N rows (gate then up) and the epilogue is silu(gate) * up. Row counts are runtime arguments
    (one compiled kernel serves every batch size); N and K are compile-time (fixed per model)."""
    # Grouped tile order: GROUP_M consecutive M tiles share each N tile while it is in L2.
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_n_tiles
    first_m = (pid // tiles_per_group) * GROUP_M
    group_size = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_size
    pid_n = (pid % tiles_per_group) // group_size

    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return  # a tile past the last expert's padded run
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = rows < num_pairs
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_base + offs_n[None, :] * stride_bn + (k0 + offs_k)[:, None], mask=b_mask, other=0.0)
        if FP8:
            a_s = tl.load(a_scale_ptr + a_rows * stride_as + k0 // SCALE_K, mask=row_mask, other=0.0)
            b_s = tl.load(b_scale_ptr + expert * stride_bse + (offs_n // SCALE_N) * stride_bsn + k0 // SCALE_K,
                          mask=n_mask, other=0.0)
            acc += dot(a, b, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), F32) * a_s[:, None] * b_s[None, :]
        else:
            acc = dot(a, b.to(a.dtype), acc, F32)
        if GATED:
            b_up = tl.load(b_base + (N + offs_n)[None, :] * stride_bn + (k0 + offs_k)[:, None], mask=b_mask,
                           other=0.0)
            if FP8:
                b_s_up = tl.load(b_scale_ptr + expert * stride_bse + ((N + offs_n) // SCALE_N) * stride_bsn
                                 + k0 // SCALE_K, mask=n_mask, other=0.0)
                acc_up += dot(a, b_up, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), F32) * a_s[:, None] * b_s_up[None, :]
            else:
                acc_up = dot(a, b_up.to(a.dtype), acc_up, F32)

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if ROUTED_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def _moe_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
              out: torch.Tensor, routing: AlignedRouting, topk_weights: torch.Tensor | None, a_row_div: int,
              gated: bool, cfg: MoEConfig, scale_block: tuple[int, int] | None) -> None:
    n = out.shape[1]
    k = a.shape[1]
    num_m_tiles = routing.expert_ids.numel()
    grid = (num_m_tiles * triton.cdiv(n, cfg.block_n),)
    fp8 = w_scale is not None
    _moe_gemm_kernel[grid](
        a, w, out, a_scale if fp8 else a, w_scale if fp8 else w, topk_weights if topk_weights is not None else a,
        routing.sorted_ids, routing.expert_ids, routing.num_pairs, num_m_tiles,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        a_scale.stride(0) if fp8 else 0, w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0,
        N=n, K=k, A_ROW_DIV=a_row_div, GATED=gated,
        ROUTED_WEIGHT=topk_weights is not None, FP8=fp8,
        SCALE_N=scale_block[0] if fp8 else 1, SCALE_K=scale_block[1] if fp8 else 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        F32=interpreting(_moe_gemm_kernel), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_moe_triton(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, fp8_scales: Fp8BlockScales | None = None,
                     config: MoEConfig | None = None, tuner: MoETuner | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype; ``config`` forces a launch configuration, else ``tuner`` or the heuristic."""
    tokens, hidden = x.shape
    experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    block = fp8_scales.block if fp8_scales is not None else None
    if tokens == 0:
        return torch.empty_like(x)
    assert x.stride(-1) == 1 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    shape = MoEShape(tokens, experts, inter, hidden, top_k, str(w_gate_up.dtype).removeprefix("torch."), block)

    def run(cfg: MoEConfig) -> torch.Tensor:
        routing = align_routing(topk_ids, experts, cfg.block_m)
        pair_weights = topk_weights.flatten().float().contiguous()
        a, a_scale = (x, None) if block is None else per_token_group_quant_fp8_triton(x, block[1])
        intermediate = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
        _moe_gemm(a, a_scale, w_gate_up, None if block is None else fp8_scales.gate_up, intermediate, routing,
                  None, top_k, True, cfg, block)
        a, a_scale = (intermediate, None) if block is None else per_token_group_quant_fp8_triton(intermediate,
                                                                                                 block[1])
        # zeros: the pairs of other ranks' experts (id E, expert parallelism) are skipped and must add nothing.
        out = torch.zeros(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
        _moe_gemm(a, a_scale, w_down, None if block is None else fp8_scales.down, out, routing, pair_weights, 1,
                  False, cfg, block)
        return out.view(tokens, top_k, hidden).sum(1).to(x.dtype)

    cfg = config or (tuner.config(shape, run, x.device) if tuner is not None else heuristic_config(shape))
    return run(cfg)
