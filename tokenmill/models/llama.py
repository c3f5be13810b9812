"""Dense GQA decoder family: Llama, Qwen2, Mistral, SmolLM (RMSNorm, RoPE, SwiGLU, optional tied embeddings).

Tensor parallel over ``tp.size`` ranks (Megatron's split): each rank holds its query heads (and the KV heads they
read: split when there are at least as many as ranks, else one, replicated), the matching columns of ``o_proj``, its
share of the MLP width (rows of gate/up, columns of down) and its rows of the vocabulary. ``o_proj`` and ``down_proj``
give partial sums: one all-reduce after each half of a block. Norms are replicated.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.backend import KernelChoice
from tokenmill.models.base import DecoderLM
from tokenmill.models.config import ModelConfig, tp_split
from tokenmill.models.layers.attention import PagedGQAttention
from tokenmill.models.layers.mlp import SwiGLU
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.layers.vocab import VocabParallelEmbedding, vocab_rows_per_rank


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelConfig, index: int, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = PagedGQAttention(a.hidden_size, tp_split(a.num_heads, tp.size, "attention heads"),
                                          a.local_kv_heads(tp.size), a.head_dim, a.attention_bias, rotary, index)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = SwiGLU(a.hidden_size, tp_split(a.intermediate_size, tp.size, "the MLP width"))

    def forward(self, x, positions):
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), positions))
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class LlamaForCausalLM(DecoderLM):
    def __init__(self, config: ModelConfig, kernels: KernelChoice = KernelChoice(),
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        a = self.config = config
        self.tp = tp
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position, a.rope)
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(a, i, self.rotary, tp) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, vocab_rows_per_rank(a.vocab_size, tp), bias=False)
        self.requires_grad_(False)
        self.use_kernels(kernels)

    # --- weights
    def weight_shard(self, name: str) -> tuple[int, slice] | None:
        """The (dimension, slice) of checkpoint tensor ``name`` this rank loads; None: all of it."""
        a, tp = self.config, self.tp
        if tp.size == 1:
            return None
        part = name.split(".")[-2]
        q_size, d = a.num_heads * a.head_dim, a.head_dim
        if part == "q_proj":
            return 0, slice(*tp.span(q_size))
        if part in ("k_proj", "v_proj"):
            first = tp.rank * a.num_kv_heads // tp.size  # this rank's first KV head (or its replicated one)
            return 0, slice(first * d, (first + a.local_kv_heads(tp.size)) * d)
        if part == "o_proj":
            return 1, slice(*tp.span(q_size))
        if part in ("gate_proj", "up_proj"):
            return 0, slice(*tp.span(a.intermediate_size))
        if part == "down_proj":
            return 1, slice(*tp.span(a.intermediate_size))
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.embed_tokens.shard(a.vocab_size)
        return None

    def linear_sources(self) -> dict[str, tuple[str, ...]]:
        """Each linear layer (module path) -> the checkpoint modules its weight is made of, in row order."""
        sources = {}
        for i in range(self.config.num_layers):
            ckpt = f"model.layers.{i}"
            sources[f"layers.{i}.self_attn.qkv_proj"] = tuple(f"{ckpt}.self_attn.{p}_proj" for p in "qkv")
            sources[f"layers.{i}.self_attn.o_proj"] = (f"{ckpt}.self_attn.o_proj",)
            sources[f"layers.{i}.mlp.gate_up_proj"] = (f"{ckpt}.mlp.gate_proj", f"{ckpt}.mlp.up_proj")
            sources[f"layers.{i}.mlp.down_proj"] = (f"{ckpt}.mlp.down_proj",)
        sources["lm_head"] = ("model.embed_tokens",) if self.config.tie_word_embeddings else ("lm_head",)
        return sources

    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint tensor ``name`` -> (this model's parameter or buffer name, the first row it fills in a fused
        q/k/v or gate/up tensor, else None); None for tensors the model does not keep (rotary tables)."""
        if "rotary_emb" in name:
            return None
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", attn.q_size),
                 "v_proj": ("qkv_proj", attn.q_size + attn.kv_size),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", mlp.intermediate)}
        parts = name.removeprefix("model.").split(".")
        if len(parts) >= 2 and parts[-2] in fused:
            target, offset = fused[parts[-2]]
            return ".".join(parts[:-2] + [target, parts[-1]]), offset
        return self.tied_head_target(".".join(parts)), None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (this rank's slices, ``weight_shard``) in, fusing q/k/v and gate/up; every parameter
        and quantized buffer must be filled exactly once."""
        params = self.loadable_tensors()
        filled: dict[str, int] = {}
        for name, tensor in weights:
            target = self.weight_target(name)
            if target is None:
                continue
            name, offset = target
            if self.copy_quantized(name, offset, tensor, filled):
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            dst = params[name] if offset is None else params[name][offset:offset + tensor.shape[0]]
            self.copy_weight(name, dst, tensor, filled)
        self.finish_loading(filled, self.config.tie_word_embeddings)
