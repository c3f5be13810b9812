"""Causal attention of a flattened batch's queries over the paged KV cache (GQA/MHA).

Shapes: ``q[T, Hq, D]`` (T tokens of B requests, laid out by ``meta.query_start_loc``);
cache ``data[num_blocks + 1, block_size, 2 * Hkv, D]`` (K heads then V heads; the last block is the zero
null block) with optional fp8 ``scales[num_blocks + 1, block_size, 2 * Hkv]``; output ``[T, Hq, D]`` in q's
dtype. A request's queries are its last ``query_len`` tokens of ``seq_len``: query i sees keys
``0 .. seq_len - query_len + i``. The new tokens' K/V must already be written.

Reads past a sequence's end are redirected to the null block, so unused cache slots (whatever they hold,
NaN included) never reach a result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.kv_write import FP8_TO_FP16_FACTOR, dequantize, fp8_bits_as_fp16
from tokenmill.kernels.metadata import AttentionMetadata


def token_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, block_size: int,
                null_slot: int) -> torch.Tensor:
    """[B, W] block tables -> [B, num_tokens] flat slots; positions >= seq_len map to ``null_slot``."""
    pos = torch.arange(num_tokens, device=block_tables.device)
    slots = block_tables[:, pos // block_size] * block_size + pos % block_size
    return torch.where(pos < seq_lens[:, None], slots, null_slot)


def _gather(data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype
            ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Cache entries at ``slots`` [..., N] as contiguous head-major K and V: ([k, v] each [..., Hkv, N, D] in
    ``dtype``, [k_scale, v_scale] each [..., Hkv, N] or None for 16/32-bit caches).

    Contiguous head-major tensors let the products run as plain batched GEMMs. fp8 values are left unscaled
    (value = returned * scale, the scale including the bit-trick factor) so that callers can fold the scales
    into the smaller score and weight tensors.
    """
    num_slots, dim = data.shape[-2:]
    hkv = num_slots // 2
    entries = data.view(-1, num_slots, dim)[slots]  # [..., N, 2Hkv, D]
    # Transposing before the conversion moves 1-byte fp8 elements rather than floats.
    halves = [entries[..., :hkv, :].movedim(-2, -3).contiguous(), entries[..., hkv:, :].movedim(-2, -3).contiguous()]
    if scales is None:
        return [h.to(dtype) for h in halves], None
    scale = scales.view(-1, num_slots)[slots].movedim(-1, -2) * FP8_TO_FP16_FACTOR  # [..., 2Hkv, N]
    return [fp8_bits_as_fp16(h).to(dtype) for h in halves], [scale[..., :hkv, :], scale[..., hkv:, :]]


def _decode_attention(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                      valid: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [B, Hq, D] one query per request over slots [B, N] (valid [B, N]) -> [B, Hq, D]; float32 inside."""
    batch, hq, dim = q.shape
    (k, v), scale = _gather(data, scales, slots, torch.float32)  # [B, Hkv, N, D], [B, Hkv, N]
    hkv = k.shape[1]
    qg = q.float().view(batch, hkv, hq // hkv, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * sm_scale  # [B, Hkv, G, N]
    if scale is not None:  # K's per-token scale folds into the scores, V's into the weights
        scores = scores * scale[0].unsqueeze(2)
    weights = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    if scale is not None:
        weights = weights * scale[1].unsqueeze(2)
    return torch.matmul(weights, v).reshape(batch, hq, dim).to(q.dtype)


def _prefill_attention(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                       sm_scale: float) -> torch.Tensor:
    """q [L, Hq, D], the request's last L tokens, over all its slots [N] -> [L, Hq, D]."""
    q_len, hq, _ = q.shape
    seq_len = slots.shape[0]
    (k, v), scale = _gather(data, scales, slots, q.dtype)  # [Hkv, N, D], [Hkv, N]
    if scale is not None:
        k, v = k * scale[0].unsqueeze(-1).to(q.dtype), v * scale[1].unsqueeze(-1).to(q.dtype)
    if q_len == seq_len:
        mask, causal = None, True
    else:
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask, causal = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None], False
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, is_causal=causal,
                                         scale=sm_scale, enable_gqa=hq != k.shape[0])
    return out.transpose(0, 1)


def paged_attention_reference(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
                              meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    null_slot = (data.shape[0] - 1) * meta.block_size
    if meta.decode_indices:
        idx = meta.decode_indices
        rows = [meta.query_start_loc[i] for i in idx]
        lens = torch.tensor([meta.seq_lens[i] for i in idx], device=q.device)
        max_len = max(meta.seq_lens[i] for i in idx)
        slots = token_slots(meta.block_tables[idx], lens, max_len, meta.block_size, null_slot)
        valid = torch.arange(max_len, device=q.device) < lens[:, None]
        out[rows] = _decode_attention(q[rows], data, scales, slots, valid, sm_scale)
    for i in meta.prefill_indices:
        start, end, seq_len = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
        lens = torch.tensor([seq_len], device=q.device)
        slots = token_slots(meta.block_tables[i:i + 1], lens, seq_len, meta.block_size, null_slot)[0]
        out[start:end] = _prefill_attention(q[start:end], data, scales, slots, sm_scale)
    return out


def paged_attention(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, meta: AttentionMetadata,
                    sm_scale: float) -> torch.Tensor:
    return paged_attention_reference(q, data, scales, meta, sm_scale)
