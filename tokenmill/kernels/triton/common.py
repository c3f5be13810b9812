"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def interpreting(kernel) -> bool:
    """True when ``kernel`` runs under Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import time)."""
    return isinstance(kernel, InterpretedFunction)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b. F32 upcasts the operands first: the interpreter's bf16 ``tl.dot`` gives garbage (triton 3.9),
    so every kernel passes ``F32=interpreting(kernel)``; on a GPU the operands stay 16-bit/fp8 for tensor cores, and
    float32 operands multiply in IEEE float32, not TF32 (float32 is the reference precision: its results must match
    the CPU path's, as the kernel tests and benchmarks/gpu_engine_check.py require)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif (a.dtype.is_fp8() or b.dtype.is_fp8()) and a.shape[1] < 32:
        # A GPU's fp8 MMA needs K >= 32 (fp8 scale blocks of 16 give K = 16); e4m3 values are exact in bf16.
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def paged_slots(block_table_row_ptr, pos, valid, BLOCK_SIZE: tl.constexpr):
    """Flat cache slots of positions ``pos`` of one request: ``table[pos // BLOCK_SIZE] * BLOCK_SIZE +
    pos % BLOCK_SIZE`` (int64); positions that are not ``valid`` give slot 0 and must stay masked."""
    page = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return page * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def fp8_e4m3_bits(x):
    """float32 x, |x| <= 448 -> the float8_e4m3fn bit pattern (uint8) of round-to-nearest-even(x).

    Used instead of ``x.to(tl.float8e4nv)`` under the interpreter, whose cast is wrong in triton 3.9 (a rounding
    carry into the exponent is dropped: 124.5 -> 64, not 128; negative subnormals are off by one step); a GPU's
    own conversion is right and is used there. Callers store the result through a uint8 view of the fp8 tensor.
    """
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    abits = a.to(tl.int32, bitcast=True)
    rounded = (abits + 0x7FFFF + ((abits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits, ties to even
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent bias 127 -> 7
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # multiples of 2^-9; 8 encodes 2^-6
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.uint8)


def fp8_store_view(tensor, kernel):
    """The tensor a kernel stores fp8 values into: a uint8 view under the interpreter (see fp8_e4m3_bits)."""
    return tensor.view(torch.uint8) if interpreting(kernel) else tensor
