"""MLA (DeepSeek-V2/V3 multi-head latent attention) decode over the paged latent cache, absorbed form.

Cache: one slot per token, ``data[num_blocks + 1, block_size, 1, R + P]`` = [c_kv (R = kv_lora_rank, after
kv_a_layernorm) | k_pe (P = qk_rope_head_dim, roped)], fp8 with one scale per token or 16/32-bit.

Math. With W_UK[h] [N, R] and W_UV[h] [V, R] the two halves of kv_b_proj for head h, the expanded form is
    k_h(t) = [W_UK[h] c(t) ; k_pe(t)],  v_h(t) = W_UV[h] c(t),  s_h(t) = q_nope[h] . W_UK[h] c(t) + q_pe[h] . k_pe(t).
Absorbing W_UK into the query, q_lat[h] = W_UK[h]^T q_nope[h] [R], gives s_h(t) = q_lat[h] . c(t) + q_pe[h] . k_pe(t)
over the cached latent itself; this kernel returns o_lat[h] = sum_t softmax(s_h * sm_scale)(t) c(t) [R], and the
caller applies W_UV: out_h = W_UV[h] o_lat[h]. No per-head K/V is ever materialized.

Shapes: q_lat [B, H, R], q_pe [B, H, P] -> o_lat [B, H, R] (float32 inside, q's dtype out).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_write import dequantize
from tokenmill.kernels.paged_attention import token_slots


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
