"""Causal attention of a flattened batch's queries over the paged KV cache (GQA/MHA).

Shapes: ``q[T, Hq, D]`` (T tokens of B requests, laid out by ``meta.query_start_loc``);
cache ``data[num_blocks + 1, block_size, 2 * Hkv, D]`` (K heads then V heads; the last block is the zero
null block) with optional fp8 ``scales[num_blocks + 1, block_size, 2 * Hkv]``; output ``[T, Hq, D]`` in q's
dtype. A request's queries are its last ``query_len`` tokens of ``seq_len``: query i sees keys
``0 .. seq_len - query_len + i``. The new tokens' K/V must already be written.

Which K/V a query sees: a decode (query_len 1) reads all its keys from the cache; a prefill chunk reads its
cached prefix from the cache and its own tokens from ``k_new``/``v_new`` [T, Hkv, D] as computed, unquantized
(as vLLM's prefix-prefill kernel does), so a prompt's first token does not depend on the cache dtype.

Reads past a sequence's end are redirected to the null block, so unused cache slots (whatever they hold,
NaN included) never reach a result.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_write import FP8_TO_FP16_FACTOR, fp8_bits_as_fp16
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.sdpa import prefix_causal_attention


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


def _prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                       scales: torch.Tensor | None, prefix_slots: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q, k_new, v_new [L, H, D]: a chunk's own tokens, after the cached prefix at ``prefix_slots`` [P]."""
    k, v = k_new.transpose(0, 1), v_new.transpose(0, 1)  # [Hkv, L, D]
    prefix_len = prefix_slots.shape[0]
    if prefix_len:
        (k_old, v_old), scale = _gather(data, scales, prefix_slots, q.dtype)  # [Hkv, P, D], [Hkv, P]
        if scale is not None:
            k_old, v_old = k_old * scale[0].unsqueeze(-1).to(q.dtype), v_old * scale[1].unsqueeze(-1).to(q.dtype)
        k, v = torch.cat([k_old, k], dim=1), torch.cat([v_old, v], dim=1)
    return prefix_causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), sm_scale)


def paged_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                              scales: torch.Tensor | None, meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
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
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        prefix_len = meta.seq_lens[i] - (end - start)
        lens = torch.tensor([prefix_len], device=q.device)
        slots = token_slots(meta.block_tables[i:i + 1], lens, prefix_len, meta.block_size, null_slot)[0]
        out[start:end] = _prefill_attention(q[start:end], k_new[start:end], v_new[start:end], data, scales, slots,
                                            sm_scale)
    return out


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                    scales: torch.Tensor | None, meta: AttentionMetadata, sm_scale: float,
                    backend: str = "torch") -> torch.Tensor:
    """Dispatch: ``backend`` is a resolved kernel backend, "triton" or "torch" (kernels/backend.py)."""
    if backend == "triton":
        from tokenmill.kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(q, k_new, v_new, data, scales, meta, sm_scale)
    return paged_attention_reference(q, k_new, v_new, data, scales, meta, sm_scale)
