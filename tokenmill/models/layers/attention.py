"""Self-attention over the paged KV cache for the GQA/MHA family (Llama, Qwen2, Mistral, SmolLM)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels.attention_op import gqa_attention
from tokenmill.kernels.backend import KernelChoice
from tokenmill.models.layers.rotary import RotaryEmbedding


class PagedGQAttention(nn.Module):
    kernels = KernelChoice()  # set per model by DecoderLM.use_kernels

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary: RotaryEmbedding, layer_index: int):
        super().__init__()
        self.layer_index = layer_index  # which of the step's cache layers (kernels/attention_op.py) is this one's
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # Fused projection: rows [q | k | v].
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.rotary = rotary
        self.sm_scale = head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into the step's cache first."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary.apply(q.view(tokens, self.num_heads, self.head_dim), positions)
        k = self.rotary.apply(k.view(tokens, self.num_kv_heads, self.head_dim), positions)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = gqa_attention(q, k, v, self.layer_index, self.sm_scale, self.kernels.backend)
        return self.o_proj(out.reshape(tokens, self.q_size))
