"""DeepSeek-V2/V3 family: MLA attention over a latent-only paged cache, MoE FFN after the first dense layers;
DeepSeek-V3.2 and GLM-5 add DeepSeek Sparse Attention (models/layers/dsa.py) to the decoder layers.

Tensor parallel over ``tp.size`` ranks: attention heads split (q_b/q_proj and kv_b rows, o_proj columns) while the
latent path (q_a, kv_a and their norms) is replicated, so every rank computes and caches the whole latent -- each of
its heads reads all of it, which is MLA's design; routed experts split whole across ranks (expert parallel) with the
router replicated, so routing is identical everywhere; shared experts and dense MLPs split by width; the vocabulary
split by rows. One all-reduce after each half of a block (the routed and shared partial sums share it).
Weights: models/deepseek_weights.py.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.attention_op import attention_context
from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheDtype, KVCacheSpec
from tokenmill.models.base import DecoderLM
from tokenmill.models.config import ModelConfig, tp_split
from tokenmill.models.deepseek_weights import DeepseekWeights
from tokenmill.models.layers.dsa import DSAttention, Selection
from tokenmill.models.layers.mla import MLAttention
from tokenmill.models.layers.mlp import SwiGLU
from tokenmill.models.layers.moe import MoE
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.layers.vocab import VocabParallelEmbedding, vocab_rows_per_rank

# Kept float32 whatever the compute dtype: the router decides in float32, as DeepSeek's code does; fp8 scales.
_FP32_PARAMS = ("gate_weight", "e_score_correction_bias", "w_gate_up_scale", "w_down_scale",
                "indexer.weights_proj.weight")


class DeepseekLayer(nn.Module):
    def __init__(self, c: ModelConfig, index: int, rotary: RotaryEmbedding, fp8_block: tuple[int, int] | None,
                 tp: TensorParallel, selection: Selection | None = None):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DSAttention(c, rotary, index, selection or Selection(), tp) if c.dsa else \
            MLAttention(c, rotary, index, tp)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        moe = c.moe is not None and c.moe.is_moe_layer(index)
        self.mlp = MoE(c.hidden_size, c.moe, fp8_block, tp) if moe else \
            SwiGLU(c.hidden_size, tp_split(c.intermediate_size, tp.size, "the MLP width"))

    def forward(self, x, positions):
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), positions))
        return x + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))


class DeepseekMTP(nn.Module):
    """DeepSeek-V3's multi-token-prediction module, a draft model inside the checkpoint (layer ``num_layers``): at
    position i it reads the main model's final hidden state h_i and the embedding of token i+1, and its output,
    through ``norm`` and the main model's LM head, predicts token i+2. It shares the embedding and the LM head with the
    main model (the checkpoint's copies of them are the same tensors), and its attention has a cache layer of its
    own, after the decoder layers'. As vLLM and SGLang run it: [enorm(embedding) | hnorm(h)] in that order, the
    embedding zeroed at position 0, and its own output (before ``norm``) fed back as h for a further draft."""

    def __init__(self, c: ModelConfig, rotary: RotaryEmbedding, fp8_block: tuple[int, int] | None,
                 tp: TensorParallel):
        super().__init__()
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.block = DeepseekLayer(c, c.num_layers, rotary, fp8_block, tp)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # the checkpoint's shared_head.norm

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """embeds [T, H] (of the token after each position), positions [T], previous [T, H] -> [T, H]."""
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        return self.block(x, positions)


class DeepseekForCausalLM(DeepseekWeights, DecoderLM):
    fp32_params = _FP32_PARAMS
    unpacked_linears = ("kv_b_proj",)  # MLA absorbs its weight into the attention (models/layers/mla.py)

    def __init__(self, config: ModelConfig, kernels: KernelChoice = KernelChoice(), mtp: bool = False,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        c = self.config = config
        self.tp = tp
        self.weight_block = c.fp8_weight_block or (128, 128)
        # fp8 checkpoints keep their routed experts fp8 where fp8 GEMMs exist (the Triton fused MoE), with
        # activations quantized per token group as DeepSeek's own inference does; elsewhere they are dequantized at
        # load. The fused gate/up scale grid needs the gate/up boundary on a block edge.
        self.fp8_experts = c.fp8_weight_block is not None and kernels.backend == "triton" and c.moe is not None \
            and c.moe.intermediate_size % self.weight_block[0] == 0
        fp8_block = self.weight_block if self.fp8_experts else None
        self.rotary = RotaryEmbedding(c.mla.qk_rope_head_dim, c.max_position, c.rope)
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp)
        selection = Selection() if c.dsa else None  # DSA: one layer's token selection, read by the shared layers
        self.layers = nn.ModuleList(DeepseekLayer(c, i, self.rotary, fp8_block, tp, selection)
                                    for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, vocab_rows_per_rank(c.vocab_size, tp), bias=False)
        if mtp and not c.num_mtp_layers:
            raise ValueError("the checkpoint has no multi-token-prediction layer (num_nextn_predict_layers)")
        self.mtp = DeepseekMTP(c, self.rotary, fp8_block, tp) if mtp else None
        self.requires_grad_(False)
        self.use_kernels(kernels)

    @classmethod
    def compile_blocker(cls, config: ModelConfig) -> str | None:
        if config.dsa is not None:
            return "DeepSeek Sparse Attention sizes its token selection from the step's positions on the host"
        return None

    def kv_cache_spec(self, dtype: KVCacheDtype, block_size: int) -> KVCacheSpec:
        """The decoder layers' latent cache, plus one layer for the MTP module when it drafts."""
        spec = self.config.kv_cache_spec(dtype, block_size, self.tp.size)
        if self.mtp is None:
            return spec
        return dataclasses.replace(spec, num_layers=spec.num_layers + 1, groups=None)  # one full group, the MTP too

    # --- multi-token prediction (drafts; speculative/mtp.py drives it)
    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
                    meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """The MTP module over a flattened batch laid out by ``meta``: the token after each position [T],
        positions [T], the hidden state it continues [T, H] -> its output [T, H] (writes its cache layer)."""
        with attention_context(meta, kv_cache.data, kv_cache.scales):
            return self.mtp(self.embed_tokens(next_ids), positions, previous)

    def mtp_greedy(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """[S, H] outputs of the MTP module -> [S] its most likely tokens."""
        return self.compute_logits(self.mtp.norm(mtp_hidden)).argmax(dim=-1)
