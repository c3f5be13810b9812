"""Self-attention over the paged KV cache for the GQA/MHA families (models/llama.py): what a family adds (q/k norms,
a sliding window, sinks, soft-capping, its own scale, an o_proj bias) comes from ``ModelConfig.style``; windows,
sinks and soft-caps are parameters of the attention op, not code here."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.attention_op import gqa_attention
from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.rotary import rope_qk_inplace
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
        if self.q_norm is None and self.kernels.backend == "cpu" and x.device.type == "cpu":
            q, k, v = self._rotated_qkv(x, positions)
        else:
            q, k, v = self._split(self.qkv_proj(x), tokens)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary.apply_qk(q, k, positions, self.kernels.backend)
        out = gqa_attention(q, k, v, self.layer_index, self.sm_scale, self.kernels.backend, self.sinks, self.window,
                            self.softcap)
        return self.o_proj(out.reshape(tokens, self.q_size))

    def _split(self, qkv: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim),
                v.view(tokens, self.num_kv_heads, self.head_dim))

    def _rotated_qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v of the fused projection, q and k rotated by the C kernel (kernels/rotary.py) where the projection
        wrote them. Compiled, one op inductor leaves alone, with the projection where that is a layer of the CPU
        table (kernels/cpu_linear.py; such layers carry ``index``); else the rotation is an op of its own."""
        proj, rotary, tokens = self.qkv_proj, self.rotary, x.shape[0]
        if not torch.compiler.is_compiling():
            qkv = rope_qk_inplace(proj(x), positions, rotary.cos, rotary.sin, self.num_heads, self.num_kv_heads)
            return self._split(qkv, tokens)
        if type(proj) is not nn.Linear and hasattr(proj, "index"):
            qkv = torch.ops.tokenmill.cpu_linear_rope(x, proj.index, positions, rotary.cos, rotary.sin, self.num_heads,
                                                      self.num_kv_heads, self.q_size + 2 * self.kv_size)
            return self._split(qkv, tokens)
        q, k, v = self._split(proj(x), tokens)
        return (*rotary.apply_qk(q, k, positions, self.kernels.backend), v)
