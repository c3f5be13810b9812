"""Triton MLA decode: absorbed-query attention over the paged latent cache, split-KV with a log-sum-exp merge.

Same contract as ``kernels.mla.mla_decode_reference`` (its docstring has the math and the cache layout):
q_lat [B, H, R], q_pe [B, H, P] -> o_lat [B, H, R]. Each cached token is one row ``[c_kv (R) | k_pe (P)]`` of
``data`` viewed as ``[-1, R + P]``, at flat slot ``block_tables[b, p // block_size] * block_size + p % block_size``;
fp8 caches hold one scale per token, folded into the score column (K side) and the probability (V side, since
the latent c_kv is also the value).

Grid (requests, head groups of BLOCK_H, splits): a program loads each latent tile once for BLOCK_H heads, so
the cache is read H / BLOCK_H times per step instead of H times. R and P are padded to powers of two (masked),
so any kv_lora_rank works; DeepSeek-V3's (512, 64) needs no padding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.common import dot, interpreting, next_pow2, paged_slots
from tokenmill.kernels.triton.split_kv import (decode_num_splits, merge_splits, online_softmax_step, split_range,
                                               store_split)


@triton.jit
def _mla_decode_split_kernel(
        q_lat_ptr, q_pe_ptr, data_ptr, scale_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, idx_ptr, req_ptr, sm_scale,
        stride_lb, stride_lh, stride_pb, stride_ph, stride_bt, stride_idx,
        HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, SLOT, BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr, FP8: tl.constexpr, F32: tl.constexpr, SPARSE: tl.constexpr):
    """Row b attends to its positions 0 .. lens[b] - 1, or (SPARSE) to the positions idx[b, 0 .. lens[b] - 1] of
    request req[b]'s block table (DeepSeek Sparse Attention's selection, kernels/dsa.py: a row per query token). A
    cache entry is SLOT wide: [c_kv | k_pe | ...]. SLOT is a run-time argument, not a constexpr: Triton then knows
    only what its launch specialization proves (divisible by 16 or not), so entries whose bytes are not a multiple
    of 16 are never read with 16-byte vectors -- with SLOT a constexpr of 56 or 72 (fp8), the H200 hit
    'misaligned address' on 16-byte loads of c."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < HEADS
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    q_lat = tl.load(q_lat_ptr + b * stride_lb + heads[:, None] * stride_lh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(q_pe_ptr + b * stride_pb + heads[:, None] * stride_ph + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_P]

    start, end = split_range(tl.load(lens_ptr + b), split, NUM_SPLITS, BLOCK_N)
    table = bt_ptr + (tl.load(req_ptr + b).to(tl.int64) if SPARSE else b) * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        if SPARSE:
            pos = tl.load(idx_ptr + b * stride_idx + pos, mask=valid, other=-1)
            valid = valid & (pos >= 0)
        slot = paged_slots(table, pos, valid, BLOCK_SIZE)
        entry = data_ptr + slot[:, None] * SLOT
        c = tl.load(entry + offs_r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0).to(q_lat.dtype)
        k_pe = tl.load(entry + RANK + offs_p[None, :], mask=valid[:, None] & p_mask[None, :],
                       other=0.0).to(q_pe.dtype)
        s = dot(q_lat, tl.trans(c), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), F32)
        s = dot(q_pe, tl.trans(k_pe), s, F32) * sm_scale
        if FP8:
            token_scale = tl.load(scale_ptr + slot, mask=valid, other=0.0)
            s = s * token_scale[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        p, m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc)
        if FP8:
            p = p * token_scale[None, :]
        acc = dot(p.to(c.dtype), c, acc, F32)

    rows = (b * HEADS + heads) * NUM_SPLITS + split  # [B, H, NUM_SPLITS] row index
    store_split(o_ptr, lse_ptr, rows, acc, m_i, l_i, start >= end, h_mask, offs_r, r_mask, RANK)


def mla_decode_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, sm_scale: float,
                      num_splits: int | None = None, max_len: int | None = None,
                      indices: torch.Tensor | None = None, row_requests: torch.Tensor | None = None) -> torch.Tensor:
    """``indices`` [B, K] (sparse attention): row b reads only positions indices[b, :seq_lens[b]], which must be
    valid (>= 0, the selection's -1 padding after them), of request row_requests[b]'s row of ``block_tables``;
    data's entries may then be wider than R + P."""
    batch, heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    slot = data.shape[-1]
    assert data.shape[-2] == 1 and (slot == rank + rope or indices is not None and slot > rank + rope)
    assert data.is_contiguous() and q_lat.stride(-1) == q_pe.stride(-1) == 1
    block_h = 16
    head_groups = triton.cdiv(heads, block_h)
    splits = num_splits
    if splits is None:
        longest = max_len if max_len is not None else int(seq_lens.max())
        splits = decode_num_splits(batch * head_groups, longest, q_lat.device)
    o_part = torch.empty(batch, heads, splits, rank, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q_lat.device)
    _mla_decode_split_kernel[(batch, head_groups, splits)](
        q_lat, q_pe, data, scales if scales is not None else data, block_tables, seq_lens, o_part, lse,
        indices if indices is not None else seq_lens, row_requests if row_requests is not None else seq_lens,
        sm_scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), block_tables.stride(0),
        indices.stride(0) if indices is not None else 0,
        HEADS=heads, RANK=rank, ROPE=rope, SLOT=slot, BLOCK_SIZE=block_size, NUM_SPLITS=splits, BLOCK_H=block_h,
        BLOCK_N=16 if rank > 256 else 32, BLOCK_R=max(16, next_pow2(rank)), BLOCK_P=max(16, next_pow2(rope)),
        FP8=scales is not None, F32=interpreting(_mla_decode_split_kernel), SPARSE=indices is not None)
    out = torch.empty_like(q_lat)
    merge_splits(o_part, lse, out)
    return out
