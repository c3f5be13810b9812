"""Triton KV write: quantize each new (token, slot) vector and scatter it into the paged cache.

Same contract as ``kernels.kv_write.write_kv_reference``: ``new [T, S, D]`` goes to flat slots
``slot_mapping [T]`` of ``data[num_blocks + 1, block_size, S, D]``; for an fp8 cache each vector gets the scale
amax / 448 (at least 1e-12), stored in ``scales[..., S]`` float32, and the stored value is round(x / scale).
A negative slot (a padding row of a CUDA-graph batch) writes nothing. One program per (token, slot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_write import FP8_MAX, MIN_SCALE
from tokenmill.kernels.triton.common import fp8_e4m3_bits, fp8_store_view, interpreting, next_pow2


@triton.jit
def _write_kv_kernel(new_ptr, slot_ptr, data_ptr, scale_ptr,
                     new_stride_t, new_stride_s, NUM_SLOTS: tl.constexpr, DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, FP8: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
                     FP8_BITS: tl.constexpr):
    token = tl.program_id(0)
    slot_index = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < DIM
    x = tl.load(new_ptr + token * new_stride_t + slot_index * new_stride_s + offs, mask=mask, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        dest = slot * NUM_SLOTS + slot_index  # flat (slot, cache-slot) row
        if FP8:
            xf = x.to(tl.float32)  # a new name: a branch may not retype a variable
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(xf), axis=0), FP8_MAX_C), MIN_SCALE_C)
            y = tl.math.div_rn(xf, scale)  # IEEE division (``/`` is approximate on GPUs): bit-equal to the reference
            if FP8_BITS:  # data_ptr is a uint8 view (interpreter)
                tl.store(data_ptr + dest * DIM + offs, fp8_e4m3_bits(y), mask=mask)
            else:
                tl.store(data_ptr + dest * DIM + offs, y.to(data_ptr.dtype.element_ty), mask=mask)
            tl.store(scale_ptr + dest, scale)
        else:
            tl.store(data_ptr + dest * DIM + offs, x.to(data_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(data: torch.Tensor, scales: torch.Tensor | None, new: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    tokens, num_slots, dim = new.shape
    if tokens == 0:
        return
    assert data.is_contiguous() and new.stride(-1) == 1 and data.shape[-2:] == (num_slots, dim)
    fp8 = scales is not None
    _write_kv_kernel[(tokens, num_slots)](
        new, slot_mapping, fp8_store_view(data, _write_kv_kernel) if fp8 else data, scales if fp8 else data,
        new.stride(0), new.stride(1), NUM_SLOTS=num_slots, DIM=dim, BLOCK_D=next_pow2(dim),
        FP8=fp8, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, FP8_BITS=interpreting(_write_kv_kernel))
