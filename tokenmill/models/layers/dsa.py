"""DeepSeek Sparse Attention layers (DeepSeek-V3.2, GLM-5): MLA (models/layers/mla.py) whose queries attend only to
the ``index_topk`` cached tokens a lightning indexer picks (kernels/dsa.py has the math and the cache layout).

The indexer of a "full" layer: q = wq_b(q_resid) [Hi, D] from MLA's query latent, k = LayerNorm(wk(x)) [D] (one key
per token, cached beside the latent), both roped on their first qk_rope_head_dim features (V3.2: the two halves;
GLM-5: interleaved pairs, de-interleaved first as MLA's are), and per-head weights weights_proj(x) / sqrt(Hi) / sqrt(D)
(weights_proj float32 whatever the compute dtype). A "shared" layer (GLM-5's
``indexer_types``) has no indexer: it reuses the selection of the last full layer before it, which ``Selection``
carries from one layer to the next within a forward.

Tensor parallel: the indexer is whole on every rank (its weights are small), so every rank selects the same tokens
for its own heads.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.attention_op import dsa_attention_op
from tokenmill.models.config import ModelConfig
from tokenmill.models.layers.mla import MLAttention
from tokenmill.models.layers.rotary import RotaryEmbedding


class Selection:
    """The last full layer's selection [T, topk] in the current forward, for the shared layers after it."""

    def __init__(self):
        self.chosen: torch.Tensor | None = None


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        d = config.dsa
        self.heads, self.dim, self.rope_dim = d.index_n_heads, d.index_head_dim, config.mla.qk_rope_head_dim
        self.wq_b = nn.Linear(config.mla.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)
        self.rotary, self.interleaved = rotary, d.interleaved_rope
        self.scale = self.heads ** -0.5 * self.dim ** -0.5

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotates the first rope_dim features of x [T, n, D]."""
        rot, rest = x.split([self.rope_dim, self.dim - self.rope_dim], dim=-1)
        if self.interleaved:  # de-interleaved first, queries and keys alike: every q.k product is unchanged
            rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        return torch.cat([self.rotary.apply(rot, positions), rest], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> queries [T, Hi, D], per-head weights [T, Hi] (float32, scales folded in), keys [T, D]."""
        q = self._rope(self.wq_b(q_resid).view(x.shape[0], self.heads, self.dim), positions)
        k = self._rope(self.k_norm(self.wk(x)).unsqueeze(1), positions).squeeze(1)
        weights = self.weights_proj(x.float()) * self.scale  # float32, as transformers keeps it: it ranks tokens
        return q, weights, k


class DSAttention(MLAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_index: int, selection: Selection,
                 tp: TensorParallel = TensorParallel()):
        super().__init__(config, rotary, layer_index, tp)
        d = config.dsa
        self.topk, self.selection, self.index_dim = d.index_topk, selection, d.index_head_dim
        # The MTP module's layer (after the decoder layers) runs an indexer of its own, as released checkpoints have.
        full = layer_index >= len(d.layer_types) or d.layer_types[layer_index] == "full"
        self.indexer = Indexer(config, rotary) if full else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(tokens, self.heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self._rope(q_pe, positions)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        parts = [self.kv_a_layernorm(c_kv), self._rope(k_pe.unsqueeze(1), positions).squeeze(1)]
        q_index = weights = None
        if self.indexer is not None:
            q_index, weights, k_index = self.indexer(x, q_resid, positions)
            parts.append(k_index.to(c_kv.dtype))
        else:  # the slot's indexer part stays unused: this layer reads the shared selection
            parts.append(c_kv.new_zeros(tokens, self.index_dim))
        out, chosen = dsa_attention_op(q_nope, q_pe, torch.cat(parts, dim=-1), q_index, weights, self.kv_b_proj.weight,
                                       self.layer_index, self.sm_scale, self.topk, self.rope_dim,
                                       self.kernels.backend, None if self.indexer is not None
                                       else self.selection.chosen)
        self.selection.chosen = chosen
        return self.o_proj(out.reshape(tokens, self.heads * self.v_dim))
