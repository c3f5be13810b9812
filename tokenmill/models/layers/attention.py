"""Self-attention over the paged KV cache for the GQA/MHA families (models/llama.py): what a family adds (q/k norms,
a sliding window, sinks, soft-capping, its own scale, an o_proj bias) comes from ``ModelConfig.style``; windows,
sinks and soft-caps are parameters of the attention op, not code here."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.attention_op import gqa_attention
from tokenmill.kernels.backend import KernelChoice
from tokenmill.models.config import ModelConfig, tp_split
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding


class PagedGQAttention(nn.Module):
    kernels = KernelChoice()  # set per model by DecoderLM.use_kernels

    def __init__(self, c: ModelConfig, layer_index: int, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        style = c.style
        self.layer_index = layer_index  # which of the step's cache layers (kernels/attention_op.py) is this one's
        self.num_heads = tp_split(c.num_heads, tp.size, "attention heads")
        self.num_kv_heads, self.head_dim = c.local_kv_heads(tp.size), c.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Fused projection: rows [q | k | v].
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=style.o_proj_bias)
        offset = 1.0 if style.gemma_norms else 0.0
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, offset) if style.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, offset) if style.qk_norm else None
        # gpt-oss: one learned logit per (this rank's) query head joins the softmax denominator.
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if style.attention_sinks else None
        self.window, self.softcap = style.window(layer_index), style.attn_softcap
        self.rotary = rotary
        self.sm_scale = style.query_scale or self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into the step's cache first."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.apply(q, positions), self.rotary.apply(k, positions)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = gqa_attention(q, k, v, self.layer_index, self.sm_scale, self.kernels.backend, self.sinks, self.window,
                            self.softcap)
        return self.o_proj(out.reshape(tokens, self.q_size))
