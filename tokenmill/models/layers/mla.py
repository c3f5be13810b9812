"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Per token and layer the cache holds only [c_kv | k_pe]: the normalized latent (kv_lora_rank) and the roped,
head-shared key part (qk_rope_head_dim) -- see kernels/mla.py for the layout and the math.
- Prefill chunks expand the latent into per-head K/V with kv_b_proj (cached prefix from the cache, the chunk's
  own tokens as computed) and run causal attention.
- Decodes use the absorbed form: W_UK folds into the query, attention runs over the cached latent, W_UV
  applies to the latent output.
RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; de-interleaving q_pe and k_pe the same way
first turns that into the usual halves rotation and leaves every q.k product unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.kv_write import dequantize, write_kv
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.mla import mla_decode
from tokenmill.kernels.paged_attention import token_slots
from tokenmill.kernels.sdpa import prefix_causal_attention
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, yarn_mscale


class MLAttention(nn.Module):
    kernels = KernelChoice()  # set per model by DecoderLM.use_kernels

    def __init__(self, c: dict[str, Any], rotary: RotaryEmbedding, interleaved_rope: bool):
        super().__init__()
        hidden, self.heads = c["hidden_size"], c["num_attention_heads"]
        self.rank, self.rope_dim = c["kv_lora_rank"], c["qk_rope_head_dim"]
        self.nope_dim, self.v_dim = c["qk_nope_head_dim"], c["v_head_dim"]
        qk_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = c.get("q_lora_rank")
        bias = bool(c.get("attention_bias", False))
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, c.get("rms_norm_eps", 1e-6))
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, self.heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, c.get("rms_norm_eps", 1e-6))
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.rotary, self.interleaved = rotary, interleaved_rope
        self.sm_scale = qk_dim ** -0.5
        rope = rotary.params
        if rope.get("rope_type") not in (None, "default") and rope.get("mscale_all_dim"):
            self.sm_scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return self.rotary.apply(x, positions)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, nope, R], W_UV [H, v, R]."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(tokens, self.heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self._rope(q_pe, positions)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), self._rope(k_pe.unsqueeze(1), positions).squeeze(1)], -1)
        data, scales = cache
        write_kv(data, scales, latent.unsqueeze(1), meta.slot_mapping, backend=self.kernels.backend)
        out = torch.empty(tokens, self.heads, self.v_dim, dtype=x.dtype, device=x.device)
        if meta.decode_indices:
            rows = [meta.query_start_loc[i] for i in meta.decode_indices]
            out[rows] = self._decode(q_nope[rows], q_pe[rows], data, scales, meta)
        for i in meta.prefill_indices:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q_nope[start:end], q_pe[start:end], latent[start:end], data, scales,
                                           meta, i)
        return self.o_proj(out.reshape(tokens, self.heads * self.v_dim))

    def _decode(self, q_nope, q_pe, data, scales, meta: AttentionMetadata) -> torch.Tensor:
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # W_UK absorbed into the query
        tensors = meta.device_tensors(q_nope.device)
        o_lat = mla_decode(q_lat, q_pe, data, scales, tensors.decode_block_tables, tensors.decode_seq_lens,
                           meta.block_size, self.sm_scale, backend=self.kernels.backend,
                           max_len=meta.decode_max_len())
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)

    def _prefill(self, q_nope, q_pe, own_latent, data, scales, meta: AttentionMetadata, i: int) -> torch.Tensor:
        q_len = q_nope.shape[0]
        prefix_len = meta.seq_lens[i] - q_len
        latent = own_latent
        if prefix_len:
            lens = torch.tensor([prefix_len], device=q_nope.device)
            null_slot = (data.shape[0] - 1) * meta.block_size
            slots = token_slots(meta.block_tables[i:i + 1], lens, prefix_len, meta.block_size, null_slot)[0]
            prefix = dequantize(data.view(-1, data.shape[-1])[slots],
                                None if scales is None else scales.view(-1)[slots], own_latent.dtype)
            latent = torch.cat([prefix, own_latent])
        c_kv, k_pe = latent.split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(-1, self.heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.heads, -1)], dim=-1)  # [N, H, qk]
        return prefix_causal_attention(torch.cat([q_nope, q_pe], dim=-1), k, v, self.sm_scale)
