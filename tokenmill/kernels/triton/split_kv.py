"""Pieces shared by the split-KV decode kernels (GQA paged attention, MLA): the online-softmax step, storing a
split's partial result, and merging the splits.

A split covers one contiguous range of a sequence and stores its *normalized* partial output o_s and its
log-sum-exp lse_s; the merge is ``out = sum_s exp(lse_s - max) * o_s / sum_s exp(lse_s - max)``, exact in real
arithmetic, so a long context with few requests can be spread over many programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.common import next_pow2


@triton.jit
def online_softmax_step(s, m_i, l_i, acc):
    """One tile of the online softmax: s [M, N] scores (masked = -inf) -> (p, m_new, l_new, acc rescaled). A row
    that has seen only masked scores so far (a sliding window not yet reached) keeps m = -inf, l = 0, acc = 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None]


@triton.jit
def split_range(seq_len, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of a sequence's positions that split ``split`` owns: equal runs of whole BLOCK_N tiles; the
    last splits of a short sequence are empty (start >= end)."""
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    return start, tl.minimum(start + per_split, seq_len)


@triton.jit
def store_split(o_ptr, lse_ptr, rows, acc, m_i, l_i, empty, row_mask, offs_d, d_mask, DIM: tl.constexpr):
    """Store one split's normalized output rows ``o[rows, :DIM]`` and log-sum-exp ``lse[rows]``. An empty split
    (past the end of a short sequence) stores lse = -inf and zeros: it weighs nothing in the merge."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(lse_ptr + rows, tl.where(empty, float("-inf"), m_i + tl.log(l_safe)), mask=row_mask)
    out = tl.where(empty, 0.0, acc / l_safe[:, None])
    tl.store(o_ptr + rows[:, None] * DIM + offs_d[None, :], out, mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(o_part_ptr, lse_ptr, out_ptr, sink_ptr, stride_ob, stride_oh, HEADS: tl.constexpr,
                         DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (b * HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(lse_ptr + rows, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)  # split 0 is never empty, so the max is finite
    weights = tl.exp(lse - top)
    parts = tl.load(o_part_ptr + rows[:, None] * DIM + offs_d[None, :],
                    mask=(offs_s < NUM_SPLITS)[:, None] & (offs_d < DIM)[None, :], other=0.0)
    denominator = tl.sum(weights, axis=0)
    if SINKS:  # the head's sink logit joins the denominator only
        denominator += tl.exp(tl.load(sink_ptr + h) - top)
    out = tl.sum(parts * weights[:, None], axis=0) / denominator
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < DIM)


def merge_splits(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None = None
                 ) -> None:
    """o_part [B, H, S, D] float32 normalized partial outputs, lse [B, H, S] -> out [B, H, D] (any float dtype);
    ``sinks`` [H] float32: attention sinks (kernels/attention_features.py)."""
    batch, heads, splits, dim = o_part.shape
    _merge_splits_kernel[(batch, heads)](o_part, lse, out, sinks if sinks is not None else lse, out.stride(0),
                                         out.stride(1), HEADS=heads, DIM=dim, NUM_SPLITS=splits,
                                         BLOCK_S=next_pow2(splits), BLOCK_D=next_pow2(dim), SINKS=sinks is not None)


def decode_num_splits(programs_per_split: int, max_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over, but at least 256 tokens per split (merging is not free)."""
    if device.type != "cuda":
        return 1
    programs_wanted = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(programs_wanted, programs_per_split), triton.cdiv(max_len, 256), 64))
