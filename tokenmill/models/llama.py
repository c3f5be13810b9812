"""Dense GQA decoder family: Llama, Qwen2, Mistral, SmolLM (RMSNorm, RoPE, SwiGLU, optional tied embeddings)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.kernels.backend import KernelChoice
from tokenmill.models.base import DecoderLM
from tokenmill.models.config import ModelConfig
from tokenmill.models.layers.attention import PagedGQAttention
from tokenmill.models.layers.mlp import SwiGLU
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelConfig, index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = PagedGQAttention(a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
                                          a.attention_bias, rotary, index)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = SwiGLU(a.hidden_size, a.intermediate_size)

    def forward(self, x, positions):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(DecoderLM):
    def __init__(self, config: ModelConfig, kernels: KernelChoice = KernelChoice()):
        super().__init__()
        a = self.config = config
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position, a.rope)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i, self.rotary) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.requires_grad_(False)
        self.use_kernels(kernels)

    # --- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be filled exactly once."""
        a = self.config
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", a.num_heads * a.head_dim),
                 "v_proj": ("qkv_proj", (a.num_heads + a.num_kv_heads) * a.head_dim),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", a.intermediate_size)}
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, offset = fused[parts[-2]]
                name = ".".join(parts[:-2] + [target, parts[-1]])
                dst = params[name].data[offset:offset + tensor.shape[0]]
            elif name in params:
                dst = params[name].data
            else:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled[name] = filled.get(name, 0) + tensor.numel()
        self.finish_loading(filled, a.tie_word_embeddings)
