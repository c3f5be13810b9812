"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Per token and layer the cache holds only [c_kv | k_pe]: the normalized latent (kv_lora_rank) and the roped,
head-shared key part (qk_rope_head_dim) -- see kernels/mla.py for the layout and the math.
The layer computes queries and latents, writes the latents to the cache and calls one op, ``kernels.mla_attention``,
which pages (prefill chunks expand the latent with kv_b_proj; decodes run absorbed: W_UK folds into the query, W_UV
applies to the latent output).
RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; de-interleaving q_pe and k_pe the same way
first turns that into the usual halves rotation and leaves every q.k product unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.attention_op import mla_attention_op
from tokenmill.kernels.backend import KernelChoice
from tokenmill.models.config import ModelConfig, tp_split
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, yarn_mscale


class MLAttention(nn.Module):
    kernels = KernelChoice()  # set per model by DecoderLM.use_kernels

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_index: int,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.layer_index = layer_index  # which of the step's cache layers (kernels/attention_op.py) is this one's
        c = config.mla
        # This rank's heads; the latent (q_a, kv_a and their norms) is whole on every rank.
        hidden, self.heads = config.hidden_size, tp_split(config.num_heads, tp.size, "attention heads")
        self.rank, self.rope_dim = c.kv_lora_rank, c.qk_rope_head_dim
        self.nope_dim, self.v_dim = c.qk_nope_head_dim, c.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = c.q_lora_rank
        bias = config.attention_bias
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, self.heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.rotary, self.interleaved = rotary, c.interleaved_rope
        self.sm_scale = qk_dim ** -0.5
        rope = rotary.params
        if rope.get("rope_type") not in (None, "default") and rope.get("mscale_all_dim"):
            self.sm_scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return self.rotary.apply(x, positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(tokens, self.heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self._rope(q_pe, positions)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), self._rope(k_pe.unsqueeze(1), positions).squeeze(1)], -1)
        out = mla_attention_op(q_nope, q_pe, latent, self.kv_b_proj.weight, self.layer_index, self.sm_scale,
                               self.kernels.backend)
        return self.o_proj(out.reshape(tokens, self.heads * self.v_dim))
