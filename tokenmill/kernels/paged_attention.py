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
NaN included) never reach a result. ``features`` (kernels/attention_features.py: sliding window, soft-cap, sinks)
change what a query sees and how it weighs it; a windowed prefill chunk reads only the prefix its window reaches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.attention_features import PLAIN, AttentionFeatures, capped, softmax_with_sinks
from tokenmill.kernels.kv_write import FP8_TO_FP16_FACTOR, dequantize, fp8_bits_as_fp16
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.sdpa import prefix_causal_attention


def token_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, block_size: int,
                null_slot: int) -> torch.Tensor:
    """[B, W] block tables -> [B, num_tokens] flat slots; positions >= seq_len map to ``null_slot``."""
    pos = torch.arange(num_tokens, device=block_tables.device)
    slots = block_tables[:, pos // block_size] * block_size + pos % block_size
    return torch.where(pos < seq_lens[:, None], slots, null_slot)


def _gather(data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized cache entries at flat ``slots`` [..., N] -> (k, v) each [..., N, Hkv, D] in ``dtype``: views
    of one gathered tensor (strided; SDPA and the GEMMs read them without another copy)."""
    num_slots, dim = data.shape[-2:]
    hkv = num_slots // 2
    flat = data.view(-1, num_slots, dim)
    index = slots.reshape(-1)
    scale = None if scales is None else torch.index_select(scales.view(-1, num_slots), 0, index)  # [S, 2Hkv]
    entries = dequantize(torch.index_select(flat, 0, index), scale, dtype).view(*slots.shape, num_slots, dim)
    return entries[..., :hkv, :], entries[..., hkv:, :]


def _decode_attention(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                      valid: torch.Tensor, sm_scale: float, features: AttentionFeatures) -> torch.Tensor:
    """q [B, Hq, D] one query per request over slots [B, N] (valid [B, N]) -> [B, Hq, D]; float32 inside."""
    if scales is not None or features.softcap or features.sinks is not None:
        return _decode_attention_explicit(q, data, scales, slots, valid, sm_scale, features)
    batch, hq, dim = q.shape
    k, v = _gather(data, None, slots, torch.float32)  # [B, N, Hkv, D]
    out = F.scaled_dot_product_attention(  # q [B, Hq, 1, D] over k, v [B, Hkv, N, D]
        q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :],
        scale=sm_scale, enable_gqa=hq != k.shape[2])
    return out.view(batch, hq, dim).to(q.dtype)


def _decode_attention_explicit(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                               valid: torch.Tensor, sm_scale: float, features: AttentionFeatures) -> torch.Tensor:
    """Scores, cap, mask, softmax (with sinks) as plain batched GEMMs. An fp8 cache: K's per-token scales fold into
    the scores and V's into the weights ([B, Hkv, G, N] each), cheaper than scaling the widened [B, N, 2Hkv, D]
    entries; 1-byte codes move into head-major order before widening."""
    batch, hq, dim = q.shape
    num_slots = data.shape[-2]
    hkv = num_slots // 2
    index = slots.reshape(-1)
    codes = torch.index_select(data.view(-1, num_slots, dim), 0, index).view(batch, -1, num_slots, dim)
    # [B, Hkv, N, D] each, contiguous (so that matmul batches over B x Hkv without copying); fp8: value / 256.
    widen = (lambda t: fp8_bits_as_fp16(t).float()) if scales is not None else (lambda t: t.float())
    k, v = (widen(codes[:, :, half].movedim(2, 1).contiguous()) for half in (slice(0, hkv), slice(hkv, None)))
    qg = q.float().view(batch, hkv, hq // hkv, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * sm_scale  # [B, Hkv, G, N]
    if scales is not None:
        scale = torch.index_select(scales.view(-1, num_slots), 0, index).view(batch, -1, num_slots)
        scale = (scale * FP8_TO_FP16_FACTOR).transpose(1, 2).unsqueeze(2)  # [B, 2Hkv, 1, N]
        scores = scores * scale[:, :hkv]
    scores = capped(scores, features.softcap).masked_fill(~valid[:, None, None, :], float("-inf"))
    weights = softmax_with_sinks(scores.view(batch, hq, 1, -1), features.sinks).view(scores.shape)
    if scales is not None:
        weights = weights * scale[:, hkv:]
    return torch.matmul(weights, v).reshape(batch, hq, dim).to(q.dtype)


def _prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                       scales: torch.Tensor | None, prefix_slots: torch.Tensor, sm_scale: float,
                       features: AttentionFeatures) -> torch.Tensor:
    """q, k_new, v_new [L, H, D]: a chunk's own tokens, after the cached prefix (the part of it the chunk's window
    reaches) at ``prefix_slots`` [P]."""
    k, v = k_new, v_new  # [L, Hkv, D]
    if prefix_slots.shape[0]:
        k_old, v_old = _gather(data, scales, prefix_slots, q.dtype)  # [P, Hkv, D]
        k, v = torch.cat([k_old, k]), torch.cat([v_old, v])
    return prefix_causal_attention(q, k, v, sm_scale, features)


def _decode_slots(meta: AttentionMetadata, null_slot: int, window: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decodes' rows in the batch [B], cache slots [B, N] and valid positions [B, N] (built once per step and
    window): positions inside the sequence and, with a window, inside the last ``window``."""
    tensors = meta.device_tensors(meta.block_tables.device)
    lens = tensors.decode_seq_lens
    max_len = meta.decode_max_len()
    slots = token_slots(tensors.decode_block_tables, lens, max_len, meta.block_size, null_slot)
    pos = torch.arange(max_len, device=lens.device)
    valid = pos < lens[:, None]
    if window:
        valid &= pos >= lens[:, None] - window
    return tensors.decode_rows, slots, valid


def paged_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                              scales: torch.Tensor | None, meta: AttentionMetadata, sm_scale: float,
                              features: AttentionFeatures = PLAIN) -> torch.Tensor:
    out = torch.empty_like(q)
    null_slot = (data.shape[0] - 1) * meta.block_size
    if meta.decode_indices:
        rows, slots, valid = meta.derived(("decode_slots", null_slot, features.window),
                                          lambda: _decode_slots(meta, null_slot, features.window))
        out[rows] = _decode_attention(q[rows], data, scales, slots, valid, sm_scale, features)
    for i in meta.prefill_indices:
        out[meta.query_start_loc[i]:meta.query_start_loc[i + 1]] = prefill_chunk_attention(
            i, q, k_new, v_new, data, scales, meta, sm_scale, features)
    return out


def prefill_chunk_attention(i: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                            scales: torch.Tensor | None, meta: AttentionMetadata, sm_scale: float,
                            features: AttentionFeatures) -> torch.Tensor:
    """Request ``i``'s prefill chunk (its rows of q) -> its output rows."""
    start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
    prefix_len = meta.seq_lens[i] - (end - start)
    first = features.first_key(prefix_len)  # the chunk's first query sees no earlier key
    null_slot = (data.shape[0] - 1) * meta.block_size
    lens = torch.tensor([prefix_len], device=q.device)
    slots = token_slots(meta.block_tables[i:i + 1], lens, prefix_len, meta.block_size, null_slot)[0, first:]
    return _prefill_attention(q[start:end], k_new[start:end], v_new[start:end], data, scales, slots, sm_scale,
                              features)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                    scales: torch.Tensor | None, meta: AttentionMetadata, sm_scale: float,
                    backend: str = "torch", features: AttentionFeatures = PLAIN) -> torch.Tensor:
    """Dispatch: ``backend`` is a resolved kernel backend, "triton", "cpu" or "torch" (kernels/backend.py)."""
    if backend == "triton":
        from tokenmill.kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(q, k_new, v_new, data, scales, meta, sm_scale, features=features)
    if backend == "cpu":
        from tokenmill.kernels.cpu_attention import paged_attention_cpu

        return paged_attention_cpu(q, k_new, v_new, data, scales, meta, sm_scale, features)
    return paged_attention_reference(q, k_new, v_new, data, scales, meta, sm_scale, features)
