"""MLA (DeepSeek-V2/V3 multi-head latent attention) over the paged latent cache: ``mla_attention`` is the one op the
layer calls (as GQA calls ``paged_attention``); decodes run absorbed, prefill chunks expanded. Paging lives here.

Cache: one slot per token, ``data[num_blocks + 1, block_size, 1, R + P]`` = [c_kv (R = kv_lora_rank, after
kv_a_layernorm) | k_pe (P = qk_rope_head_dim, roped)], fp8 with one scale per token or 16/32-bit.

Math. With W_UK[h] [N, R] and W_UV[h] [V, R] the two halves of kv_b_proj for head h, the expanded form is
    k_h(t) = [W_UK[h] c(t) ; k_pe(t)],  v_h(t) = W_UV[h] c(t),  s_h(t) = q_nope[h] . W_UK[h] c(t) + q_pe[h] . k_pe(t).
Absorbing W_UK into the query, q_lat[h] = W_UK[h]^T q_nope[h] [R], gives s_h(t) = q_lat[h] . c(t) + q_pe[h] . k_pe(t)
over the cached latent itself; this kernel returns o_lat[h] = sum_t softmax(s_h * sm_scale)(t) c(t) [R], and the
caller applies W_UV: out_h = W_UV[h] o_lat[h]. No per-head K/V is ever materialized.

Decode shapes: q_lat [B, H, R], q_pe [B, H, P] -> o_lat [B, H, R] (float32 inside, q's dtype out).

Prefill chunks expand the latent instead (cheaper when many queries share the keys): per-head K = [W_UK c ; k_pe] and
V = W_UV c for the cached prefix (read from the cache) and the chunk's own tokens (as computed, unquantized), then
causal attention through SDPA's fused kernel.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_write import dequantize
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.paged_attention import token_slots
from tokenmill.kernels.sdpa import prefix_causal_attention


def mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                         sm_scale: float) -> torch.Tensor:
    rank = q_lat.shape[-1]
    max_len = int(seq_lens.max())
    null_slot = (data.shape[0] - 1) * block_size
    slots = token_slots(block_tables, seq_lens, max_len, block_size, null_slot)  # [B, N]
    entries = data.view(-1, data.shape[-1])[slots]  # [B, N, R + P]
    latent = dequantize(entries, None if scales is None else scales.view(-1)[slots], torch.float32)
    c_kv, k_pe = latent[..., :rank], latent[..., rank:]
    scores = (torch.einsum("bhr,bnr->bhn", q_lat.float(), c_kv)
              + torch.einsum("bhp,bnp->bhn", q_pe.float(), k_pe)) * sm_scale
    valid = torch.arange(max_len, device=q_lat.device) < seq_lens[:, None]
    weights = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhn,bnr->bhr", weights, c_kv).to(q_lat.dtype)


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, sm_scale: float,
               backend: str = "torch", max_len: int | None = None) -> torch.Tensor:
    """Dispatch: ``backend`` is a resolved kernel backend, "triton" or "torch" (kernels/backend.py); ``max_len``
    (the longest of ``seq_lens``, known on the host) spares the Triton path a device-to-host sync."""
    if backend == "triton":
        from tokenmill.kernels.triton.mla import mla_decode_triton

        return mla_decode_triton(q_lat, q_pe, data, scales, block_tables, seq_lens, block_size, sm_scale,
                                 max_len=max_len)
    return mla_decode_reference(q_lat, q_pe, data, scales, block_tables, seq_lens, block_size, sm_scale)


def _cached_prefix(data: torch.Tensor, scales: torch.Tensor | None, meta: AttentionMetadata, i: int, prefix_len: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Request i's first ``prefix_len`` cached latents [P, R + P_rope], dequantized to ``dtype``."""
    lens = torch.tensor([prefix_len], device=data.device)
    null_slot = (data.shape[0] - 1) * meta.block_size
    slots = token_slots(meta.block_tables[i:i + 1], lens, prefix_len, meta.block_size, null_slot)[0]
    return dequantize(data.view(-1, data.shape[-1])[slots], None if scales is None else scales.view(-1)[slots], dtype)


def mla_prefill_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, prefix: torch.Tensor | None,
                          w_kv_b: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """One chunk: q_nope [L, H, N], q_pe [L, H, P], its own latents [L, R + P], the cached prefix's [Pre, R + P] or
    None, ``w_kv_b`` [H * (N + V), R] (kv_b_proj) -> [L, H, V]."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rank = w_kv_b.shape[1]
    if prefix is not None:
        latent = torch.cat([prefix, latent])
    c_kv, k_pe = latent.split([rank, latent.shape[-1] - rank], dim=-1)
    kv = torch.nn.functional.linear(c_kv, w_kv_b).view(latent.shape[0], heads, -1)  # [N_all, H, N + V]
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
    return prefix_causal_attention(torch.cat([q_nope, q_pe], dim=-1), k, v, sm_scale)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, data: torch.Tensor,
                  scales: torch.Tensor | None, meta: AttentionMetadata, w_kv_b: torch.Tensor, sm_scale: float,
                  backend: str = "torch") -> torch.Tensor:
    """The flattened batch's MLA: q_nope [T, H, N], q_pe [T, H, P] (roped), latent [T, R + P] (this step's, already
    written to the cache), ``w_kv_b`` [H * (N + V), R] -> [T, H, V] in q's dtype. Decodes read everything from the
    cache (absorbed, ``mla_decode``); a prefill chunk reads its prefix from the cache and its own latents as given."""
    tokens, heads, nope = q_nope.shape
    rank = w_kv_b.shape[1]
    w = w_kv_b.view(heads, -1, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, N, R], [H, V, R]
    out = torch.empty(tokens, heads, w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
    if meta.decode_indices:
        tensors = meta.device_tensors(q_nope.device)
        rows = tensors.decode_rows
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope[rows], w_uk)  # W_UK absorbed into the query
        o_lat = mla_decode(q_lat, q_pe[rows], data, scales, tensors.decode_block_tables, tensors.decode_seq_lens,
                           meta.block_size, sm_scale, backend=backend, max_len=meta.decode_max_len())
        out[rows] = torch.einsum("bhr,hvr->bhv", o_lat, w_uv)  # W_UV applied to the latent output
    for i in meta.prefill_indices:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        prefix_len = meta.seq_lens[i] - (end - start)
        prefix = _cached_prefix(data, scales, meta, i, prefix_len, latent.dtype) if prefix_len else None
        out[start:end] = mla_prefill_reference(q_nope[start:end], q_pe[start:end], latent[start:end], prefix, w_kv_b,
                                               sm_scale)
    return out
