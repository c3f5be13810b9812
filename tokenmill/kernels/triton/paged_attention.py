"""Triton paged attention for GQA/MHA over the (fp8) paged KV cache: split-KV decode and varlen prefill/extend.

Same contract as ``kernels.paged_attention.paged_attention_reference`` (read its docstring for the shapes and the
cache layout). Both kernels address the cache token by token: position ``p`` of request ``b`` lives at flat slot
``block_tables[b, p // block_size] * block_size + p % block_size``, row ``slot * 2Hkv + head`` of ``data`` viewed
as ``[-1, D]``; K head ``h`` is slot-row ``h``, V head ``h`` is ``Hkv + h``. Positions at or past a sequence's
end are masked out of the loads, so whatever the unused slots hold (NaN included) never reaches a result.

fp8: the raw e4m3 values enter the dot products; K's per-token scale multiplies the score columns and V's the
probabilities (exactly the scale folding of the reference), so no dequantized copy of K/V is made.

Decode (one query per request): grid (requests, kv heads, splits). Each program owns the G = Hq / Hkv query
heads of one KV head (padded to 16 rows for tensor cores) and one contiguous range of the sequence; it writes
its normalized partial output and log-sum-exp, and ``merge_splits`` combines the splits:
``out = sum_s exp(lse_s - max) * o_s / sum_s exp(lse_s - max)``. Long contexts with few requests thus still fill
the GPU.

Prefill/extend (a chunk of L >= 2 new tokens after P cached ones): grid (query tiles, Hq). Stage 1 attends to
the P cached tokens (no causal mask: all precede the chunk), stage 2 to the chunk's own unquantized K/V
(``k_new``/``v_new``) with the causal mask, one online softmax across both.

Attention features (kernels/attention_features.py) are constexprs: a window narrows each decode's range (its
splits cover only the last ``window`` positions) and masks the prefill tiles per query; soft-capping caps the
scores after the fp8 scale; sinks join the final denominator (the split merge's for decode, the prefill store's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.attention_features import PLAIN, AttentionFeatures
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.triton.common import dot, interpreting, next_pow2, paged_slots
from tokenmill.kernels.triton.split_kv import (decode_num_splits, merge_splits, online_softmax_step, split_range,
                                               store_split)


@triton.jit
def _capped(s, SOFTCAP: tl.constexpr):
    if SOFTCAP > 0:  # softcap * tanh(s / softcap), tanh through the sigmoid (tl has no tanh of its own)
        s = SOFTCAP * (2.0 * tl.sigmoid(2.0 * s / SOFTCAP) - 1.0)
    return s


@triton.jit
def _attend_cached_tile(q, data_ptr, scale_ptr, block_table_row_ptr, pos, valid, qpos, kvh, offs_d, d_mask, m_i,
                        l_i, acc, sm_scale, BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr, DIM: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, F32: tl.constexpr,
                        WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step of queries q [BLOCK_Q, BLOCK_D] (at positions ``qpos``, read only with a WINDOW)
    over the cached positions ``pos`` (``valid`` ones) of KV head ``kvh`` of one request -> (m_i, l_i, acc). fp8:
    K's scale multiplies the scores, V's the weights."""
    row = paged_slots(block_table_row_ptr, pos, valid, BLOCK_SIZE) * (2 * HKV)  # slot-row 0 of each token
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(data_ptr + (row + kvh)[:, None] * DIM + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(data_ptr + (row + HKV + kvh)[:, None] * DIM + offs_d[None, :], mask=kv_mask, other=0.0)
    s = dot(q, tl.trans(k.to(q.dtype)), tl.zeros([BLOCK_Q, BLOCK_N], tl.float32), F32) * sm_scale
    if FP8:
        s = s * tl.load(scale_ptr + row + kvh, mask=valid, other=0.0)[None, :]
    s = _capped(s, SOFTCAP)
    visible = valid[None, :]
    if WINDOW > 0:
        visible = visible & (pos[None, :] > qpos[:, None] - WINDOW)
    s = tl.where(visible, s, float("-inf"))
    p, m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc)
    if FP8:
        p = p * tl.load(scale_ptr + row + HKV + kvh, mask=valid, other=0.0)[None, :]
    return m_i, l_i, dot(p.to(q.dtype), v.to(q.dtype), acc, F32)


@triton.jit
def _decode_split_kernel(
        q_ptr, data_ptr, scale_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, sm_scale,
        stride_qb, stride_qh, stride_bt, BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr,
        DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, FP8: tl.constexpr, F32: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < DIM
    heads = kvh * GROUP + offs_g  # [BLOCK_G] query heads of this KV head
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    seq_len = tl.load(lens_ptr + b)
    first = 0  # the window's first position
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    start, end = split_range(seq_len - first, split, NUM_SPLITS, BLOCK_N)
    start, end = start + first, end + first

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        m_i, l_i, acc = _attend_cached_tile(q, data_ptr, scale_ptr, bt_ptr + b * stride_bt, pos, valid, offs_g,
                                            kvh, offs_d, d_mask, m_i, l_i, acc, sm_scale, BLOCK_SIZE, HKV, DIM,
                                            BLOCK_G, BLOCK_N, FP8, F32, 0, SOFTCAP)

    out_rows = (b * HKV * GROUP + heads) * NUM_SPLITS + split  # [B, Hq, NUM_SPLITS] row index
    store_split(o_ptr, lse_ptr, out_rows, acc, m_i, l_i, start >= end, g_mask, offs_d, d_mask, DIM)


def paged_decode_triton(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, block_size: int, sm_scale: float, num_splits: int,
                        features: AttentionFeatures = PLAIN) -> torch.Tensor:
    """q [B, Hq, D] (one query per request, the last of its ``seq_lens`` tokens, already in the cache)
    -> [B, Hq, D] in q's dtype."""
    batch, hq, dim = q.shape
    hkv = data.shape[-2] // 2
    group = hq // hkv
    o_part = torch.empty(batch, hq, num_splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=q.device)
    assert q.stride(-1) == 1 and data.is_contiguous()
    _decode_split_kernel[(batch, hkv, num_splits)](
        q, data, scales if scales is not None else data, block_tables, seq_lens, o_part, lse, sm_scale,
        q.stride(0), q.stride(1), block_tables.stride(0), BLOCK_SIZE=block_size, HKV=hkv, GROUP=group, DIM=dim,
        NUM_SPLITS=num_splits, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=32, BLOCK_D=max(16, next_pow2(dim)),
        FP8=scales is not None, F32=interpreting(_decode_split_kernel), WINDOW=features.window,
        SOFTCAP=float(features.softcap))
    out = torch.empty_like(q)
    merge_splits(o_part, lse, out, features.sinks)
    return out


@triton.jit
def _prefill_kernel(
        q_ptr, k_new_ptr, v_new_ptr, data_ptr, scale_ptr, bt_ptr, cu_q_ptr, lens_ptr, work_ptr, o_ptr, sink_ptr,
        sm_scale,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
        BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
        F32: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    req = tl.load(work_ptr + 2 * tl.program_id(0))
    m_start = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
    h = tl.program_id(1)
    kvh = h // GROUP
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    prefix_len = tl.load(lens_ptr + req) - q_len

    offs_m = m_start + tl.arange(0, BLOCK_M)  # query index within the chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Stage 1: the cached prefix, from the paged cache (with a window, from the tile's first query's first key).
    first = 0
    if WINDOW > 0:
        first = tl.maximum(prefix_len + m_start - WINDOW + 1, 0)
    for n0 in range(first, prefix_len, BLOCK_N):
        pos = n0 + offs_n
        m_i, l_i, acc = _attend_cached_tile(q, data_ptr, scale_ptr, bt_ptr + req * stride_bt, pos, pos < prefix_len,
                                            prefix_len + offs_m, kvh, offs_d, d_mask, m_i, l_i, acc, sm_scale,
                                            BLOCK_SIZE, HKV, DIM, BLOCK_M, BLOCK_N, FP8, F32, WINDOW, SOFTCAP)

    # Stage 2: the chunk's own tokens, unquantized, causal. Query i sees own tokens 0..i (and > i - WINDOW).
    own_end = tl.minimum(q_len, m_start + BLOCK_M)
    own_first = 0
    if WINDOW > 0:
        own_first = tl.maximum(m_start - WINDOW + 1, 0)
    for n0 in range(own_first, own_end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < q_len
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_new_ptr + (q_start + pos)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_new_ptr + (q_start + pos)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = _capped(dot(q, tl.trans(k.to(q.dtype)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), F32) * sm_scale,
                    SOFTCAP)
        visible = valid[None, :] & (pos[None, :] <= offs_m[:, None])
        if WINDOW > 0:
            visible = visible & (pos[None, :] > offs_m[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        p, m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc)
        acc = dot(p.to(q.dtype), v.to(q.dtype), acc, F32)

    if SINKS:  # the head's sink logit joins the denominator only
        l_i += tl.exp(tl.load(sink_ptr + h) - m_i)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                         scales: torch.Tensor | None, meta: AttentionMetadata, sm_scale: float,
                         out: torch.Tensor, block_m: int = 32, features: AttentionFeatures = PLAIN) -> None:
    """Writes ``out`` rows of the requests in ``meta.prefill_indices`` (queries q [T, Hq, D], own K/V
    k_new/v_new [T, Hkv, D])."""
    hq, dim = q.shape[1:]
    hkv = data.shape[-2] // 2
    tensors = meta.device_tensors(q.device)
    def work_list() -> torch.Tensor:  # (request, first query of the tile) per program
        work = [(i, m) for i in meta.prefill_indices
                for m in range(0, meta.query_start_loc[i + 1] - meta.query_start_loc[i], block_m)]
        return torch.tensor(work, dtype=torch.int32, device=q.device)
    work_t = meta.derived(("prefill_work", block_m), work_list)
    assert q.stride(-1) == k_new.stride(-1) == v_new.stride(-1) == out.stride(-1) == 1 and data.is_contiguous()
    _prefill_kernel[(work_t.shape[0], hq)](
        q, k_new, v_new, data, scales if scales is not None else data, meta.block_tables,
        tensors.query_start_loc, tensors.seq_lens, work_t, out,
        features.sinks if features.sinks is not None else out, sm_scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        BLOCK_SIZE=meta.block_size, HKV=hkv, GROUP=hq // hkv, DIM=dim, BLOCK_M=block_m, BLOCK_N=32,
        BLOCK_D=max(16, next_pow2(dim)), FP8=scales is not None, F32=interpreting(_prefill_kernel),
        WINDOW=features.window, SOFTCAP=float(features.softcap), SINKS=features.sinks is not None)


def paged_attention_triton(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                           scales: torch.Tensor | None, meta: AttentionMetadata, sm_scale: float,
                           num_splits: int | None = None, features: AttentionFeatures = PLAIN) -> torch.Tensor:
    out = torch.empty_like(q)
    if meta.decode_indices:
        idx = meta.decode_indices
        tensors = meta.device_tensors(q.device)
        hkv = data.shape[-2] // 2
        splits = num_splits or decode_num_splits(len(idx) * hkv, meta.decode_max_len(), q.device)
        out[tensors.decode_rows] = paged_decode_triton(q[tensors.decode_rows], data, scales,
                                                       tensors.decode_block_tables, tensors.decode_seq_lens,
                                                       meta.block_size, sm_scale, splits, features)
    if meta.prefill_indices:
        paged_prefill_triton(q, k_new, v_new, data, scales, meta, sm_scale, out, features=features)
    return out
