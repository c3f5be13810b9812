"""Llama-style GQA decoders: Llama, Mistral, Qwen2, Qwen3 (dense and MoE), GLM-4.5, gpt-oss, Gemma 3, SmolLM.

One block (RMSNorm, RoPE, GQA attention over the paged cache, an MLP or an MoE) whose family differences come from
the config (models/families.py): q/k norms, sliding windows, sinks, soft-caps, Gemma's (1 + w) norms around both
halves of the block and scaled embeddings, partial rotary, MoE layers (models/layers/moe.py). Weights:
models/llama_weights.py.

Tensor parallel over ``tp.size`` ranks (Megatron's split): each rank holds its query heads (and the KV heads they
read: split when there are at least as many as ranks, else one, replicated), the matching columns of ``o_proj``, its
share of the MLP width (rows of gate/up, columns of down), its routed experts whole (expert parallel, the router
replicated) and its rows of the vocabulary. ``o_proj`` and ``down_proj`` give partial sums: one all-reduce after each
half of a block. Norms are replicated.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.backend import KernelChoice
from tokenmill.models.base import DecoderLM
from tokenmill.models.config import ModelConfig, tp_split
from tokenmill.models.layers.attention import PagedGQAttention
from tokenmill.models.layers.mlp import SwiGLU
from tokenmill.models.layers.moe import MoE
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.layers.vocab import VocabParallelEmbedding, vocab_rows_per_rank
from tokenmill.models.llama_weights import LlamaWeights


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelConfig, index: int, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        offset = 1.0 if a.style.gemma_norms else 0.0
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, offset)
        self.self_attn = PagedGQAttention(a, index, rotary, tp)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, offset)
        # Gemma: post_attention_layernorm normalizes the attention's output; these two wrap the MLP.
        self.pre_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, offset) if offset else None
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, offset) if offset else None
        if a.moe is not None and a.moe.is_moe_layer(index):
            self.mlp = MoE(a.hidden_size, a.moe, None, tp)
        else:
            self.mlp = SwiGLU(a.hidden_size, tp_split(a.intermediate_size, tp.size, "the MLP width"),
                              a.style.hidden_act)

    def forward(self, x, positions):
        if self.pre_feedforward_layernorm is not None:  # Gemma's four norms
            x = x + self.post_attention_layernorm(
                self.tp.all_reduce(self.self_attn(self.input_layernorm(x), positions)))
            return x + self.post_feedforward_layernorm(
                self.tp.all_reduce(self.mlp(self.pre_feedforward_layernorm(x))))
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), positions))
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class LlamaForCausalLM(LlamaWeights, DecoderLM):
    # The router decides in float32 (as DeepSeek's and GLM's code does); sinks enter the softmax in float32.
    fp32_params = ("gate_weight", "gate_bias", "e_score_correction_bias", "sinks")

    def __init__(self, config: ModelConfig, kernels: KernelChoice = KernelChoice(),
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        a = self.config = config
        self.tp = tp
        self.rotary = RotaryEmbedding(a.rotary_dim, a.max_position, a.rope)
        # Gemma 3's sliding layers rotate with their own base.
        local = RotaryEmbedding(a.rotary_dim, a.max_position, a.style.local_rope) if a.style.local_rope else None
        self.rotaries = (self.rotary,) if local is None else (self.rotary, local)
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, tp)
        self.embed_scale = math.sqrt(a.hidden_size) if a.style.gemma_norms else 1.0
        self.layers = nn.ModuleList(
            DecoderLayer(a, i, local if local is not None and a.style.window(i) else self.rotary, tp)
            for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, 1.0 if a.style.gemma_norms else 0.0)
        self.lm_head = nn.Linear(a.hidden_size, vocab_rows_per_rank(a.vocab_size, tp), bias=False)
        self.requires_grad_(False)
        self.use_kernels(kernels)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # Gemma: times sqrt(hidden), rounded to the compute dtype first as transformers does.
        return x * torch.tensor(self.embed_scale, dtype=x.dtype) if self.embed_scale != 1.0 else x
