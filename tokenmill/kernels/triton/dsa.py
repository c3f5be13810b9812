"""Triton DeepSeek Sparse Attention: the lightning indexer's scores over the paged cache, and the batched path of
``kernels.dsa.dsa_attention`` (its docstring has the math and the cache layout) that runs it with the sparse MLA
decode kernel (kernels/triton/mla.py, ``indices``).

Indexer scores: one program per (query row, tile of BLOCK_N key positions) loads the row's Hi x D query and weights
once and each key tile once, I[t, j] = sum_h w[t, h] * relu(q[t, h] . k(j)) for j <= the row's position, -inf
past it; torch.topk then selects. fp8 caches hold one scale per token: it multiplies the key's dot products (ReLU
commutes with a positive scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.common import dot, interpreting, next_pow2, paged_slots
from tokenmill.kernels.dsa import INDEX_SCORE_BYTES
from tokenmill.kernels.triton import mla as triton_mla


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, data_ptr, scale_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr,
                         stride_qt, stride_qh, stride_wt, stride_bt, stride_ot,
                         HEADS: tl.constexpr, DIM: tl.constexpr, KEY_OFFSET: tl.constexpr, SLOT,
                         BLOCK_SIZE: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, FP8: tl.constexpr, F32: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask, d_mask = offs_h < HEADS, offs_d < DIM
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_HI, BLOCK_D]
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    position = tl.load(pos_ptr + t)
    valid = offs_n <= position
    slot = paged_slots(bt_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_bt, offs_n, valid, BLOCK_SIZE)
    # SLOT is a run-time argument, as in triton/mla.py: vector widths only as the launch proves the alignment.
    k = tl.load(data_ptr + slot[:, None] * SLOT + KEY_OFFSET + offs_d[None, :], mask=valid[:, None] & d_mask[None, :],
                other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
    s = dot(q, tl.trans(k), tl.zeros([BLOCK_HI, BLOCK_N], tl.float32), F32)
    if FP8:
        s = s * tl.load(scale_ptr + slot, mask=valid, other=0.0)[None, :]
    score = tl.sum(w[:, None] * tl.maximum(s, 0.0), axis=0)
    tl.store(out_ptr + t * stride_ot + offs_n, tl.where(valid, score, float("-inf")))


def index_scores_triton(q_index: torch.Tensor, weights: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
                        block_tables: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor, key_offset: int,
                        block_size: int, max_len: int) -> torch.Tensor:
    """q_index [T, Hi, D], weights [T, Hi] float32, each row's request (its row of ``block_tables``) and position
    [T] -> scores [T, max_len] float32, -inf past each row's position."""
    tokens, heads, dim = q_index.shape
    block_n = 32
    width = triton.cdiv(max_len, block_n) * block_n
    out = torch.empty(tokens, width, dtype=torch.float32, device=q_index.device)
    _index_scores_kernel[(tokens, width // block_n)](
        q_index, weights, data, scales if scales is not None else data, block_tables, requests, positions, out,
        q_index.stride(0), q_index.stride(1), weights.stride(0), block_tables.stride(0), out.stride(0),
        HEADS=heads, DIM=dim, KEY_OFFSET=key_offset, SLOT=data.shape[-1], BLOCK_SIZE=block_size,
        BLOCK_HI=max(16, next_pow2(heads)), BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(dim)), FP8=scales is not None,
        F32=interpreting(_index_scores_kernel))
    return out[:, :max_len]


def dsa_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, q_index: torch.Tensor | None,
                         index_weights: torch.Tensor | None, data: torch.Tensor, scales: torch.Tensor | None,
                         block_tables: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor, max_len: int,
                         block_size: int, sm_scale: float, topk: int, rank: int, rope_dim: int,
                         chosen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row at once (decodes and prefill rows alike): q_lat [T, H, R], q_pe [T, H, P], each row's
    request (its row of ``block_tables``) and position [T], ``max_len`` > every position -> (o_lat [T, H, R], the
    selection [T, topk], -1 padded at the end). The scores are computed for blocks of rows at a time (at most
    INDEX_SCORE_BYTES each)."""
    if chosen is None:
        weights = index_weights.float().contiguous()
        chosen = torch.full((q_lat.shape[0], topk), -1, dtype=torch.long, device=q_lat.device)
        rows = max(1, INDEX_SCORE_BYTES // (4 * max_len))
        for start in range(0, q_lat.shape[0], rows):
            block = slice(start, start + rows)
            scores = index_scores_triton(q_index[block], weights[block], data, scales, block_tables, requests[block],
                                         positions[block], rank + rope_dim, block_size, max_len)
            picked = scores.topk(min(topk, max_len), dim=-1).indices
            # -inf scores (past the row's position) sort last: the -1s come only at the end of a row
            chosen[block, :picked.shape[1]] = torch.where(picked <= positions[block, None], picked, -1)
    lens = (chosen >= 0).sum(-1).to(torch.int32)
    o_lat = triton_mla.mla_decode_triton(q_lat, q_pe, data, scales, block_tables, lens, block_size, sm_scale,
                                         max_len=topk, indices=chosen, row_requests=requests)
    return o_lat, chosen
