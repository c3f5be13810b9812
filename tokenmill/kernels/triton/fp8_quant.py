"""Triton per-token-group fp8 quantization of activations (spec: ``kernels.fp8.per_token_group_quant_fp8_reference``):
x [M, K] -> (fp8 [M, K], float32 scales [M, ceil(K / group)]), scale = amax / 448 of each (row, group).
One program per (row, group)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_write import FP8_DTYPE, FP8_MAX, MIN_SCALE
from tokenmill.kernels.triton.common import fp8_e4m3_bits, fp8_store_view, interpreting, next_pow2


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, COLS: tl.constexpr, GROUP: tl.constexpr,
                        NUM_GROUPS: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr,
                        MIN_SCALE_C: tl.constexpr, FP8_BITS: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < COLS)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX_C), MIN_SCALE_C)
    y = tl.math.div_rn(x, scale)  # IEEE division (``/`` is approximate on GPUs): bit-equal to the reference
    if FP8_BITS:  # q_ptr is a uint8 view (interpreter; see common.fp8_e4m3_bits)
        tl.store(q_ptr + row * COLS + cols, fp8_e4m3_bits(y), mask=mask)
    else:
        tl.store(q_ptr + row * COLS + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * NUM_GROUPS + group, scale)


def per_token_group_quant_fp8_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    num_groups = triton.cdiv(cols, group)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, num_groups, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    assert x.stride(-1) == 1
    _group_quant_kernel[(rows, num_groups)](
        x, fp8_store_view(q, _group_quant_kernel), scale, x.stride(0), COLS=cols, GROUP=group,
        NUM_GROUPS=num_groups, BLOCK=next_pow2(group), FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        FP8_BITS=interpreting(_group_quant_kernel))
    return q, scale
