"""Causal attention of a flattened batch's queries over the paged KV cache (GQA/MHA).

Shapes: ``q[T, Hq, D]`` (T tokens of B requests, laid out by ``meta.query_start_loc``);
cache ``data[num_blocks, block_size, 2 * Hkv, D]`` (K heads then V heads) with optional fp8 ``scales``;
output ``[T, Hq, D]`` in q's dtype. A request's queries are its last ``query_len`` tokens of ``seq_len``:
query i sees keys ``0 .. seq_len - query_len + i``. The new tokens' K/V must already be written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.kv_write import dequantize
from tokenmill.kernels.metadata import AttentionMetadata


def gather_kv(data: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor, num_tokens: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the first ``num_tokens`` cache entries of each block table row: (K, V), each [B, Hkv, N, D]."""
    batch, _ = block_tables.shape
    num_blocks_used = -(-num_tokens // data.shape[1])
    table = block_tables[:, :num_blocks_used]
    entries = dequantize(data[table], None if scales is None else scales[table], dtype)
    entries = entries.reshape(batch, -1, *data.shape[2:])[:, :num_tokens]  # [B, N, 2*Hkv, D]
    k, v = entries.transpose(1, 2).chunk(2, dim=1)
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [B, Hq, L, D], k/v [B, Hkv, N, D], visible [B, 1, L, N] bool -> [B, Hq, L, D]."""
    # Entries past a sequence's end are arbitrary (even NaN): zero them so that masked-out weights (0) stay 0.
    k = torch.where(visible.any(dim=2, keepdim=True).transpose(2, 3), k, 0.0)
    v = torch.where(visible.any(dim=2, keepdim=True).transpose(2, 3), v, 0.0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=sm_scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def paged_attention_reference(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
                              meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    if meta.decode_indices:
        idx = meta.decode_indices
        rows = [meta.query_start_loc[i] for i in idx]
        lens = torch.tensor([meta.seq_lens[i] for i in idx])
        max_len = int(lens.max())
        k, v = gather_kv(data, scales, meta.block_tables[idx], max_len, q.dtype)
        visible = (torch.arange(max_len) < lens[:, None]).view(len(idx), 1, 1, max_len)
        out[rows] = _attend(q[rows].unsqueeze(2), k, v, visible, sm_scale).squeeze(2)
    for i in meta.prefill_indices:
        start, end, seq_len = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
        k, v = gather_kv(data, scales, meta.block_tables[i:i + 1], seq_len, q.dtype)
        q_len = end - start
        query_pos = torch.arange(seq_len - q_len, seq_len)
        visible = (torch.arange(seq_len)[None, :] <= query_pos[:, None]).view(1, 1, q_len, seq_len)
        out[start:end] = _attend(q[start:end].transpose(0, 1).unsqueeze(0), k, v, visible, sm_scale)[0].transpose(0, 1)
    return out


def paged_attention(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, meta: AttentionMetadata,
                    sm_scale: float) -> torch.Tensor:
    return paged_attention_reference(q, data, scales, meta, sm_scale)
