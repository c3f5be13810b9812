"""MoE layer: router (DeepSeek-V2 and Qwen3-MoE softmax with greedy or group-limited top-k; DeepSeek-V3 and
GLM-4.5 sigmoid + correction bias + grouped top-k, ``noaux_tc``; gpt-oss top-k of biased logits, then their
softmax), routed experts through ``kernels.fused_moe`` (gpt-oss's with biases and its clamped SwiGLU; one opaque
op off the Triton path, kernels/moe_op.py, so that a compiled forward traces past them), and shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.moe_op import routed_experts, run_routed_experts
from tokenmill.models.config import MoEConfig, tp_split
from tokenmill.models.layers.mlp import SwiGLU


def _mask_to_groups(choice: torch.Tensor, group_scores: torch.Tensor, cfg: MoEConfig, fill: float) -> torch.Tensor:
    """Keep only the experts of the ``topk_groups`` best groups."""
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1).indices, 1.0)
    keep = keep.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1).bool()
    return choice.masked_fill(~keep, fill)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: MoEConfig,
          logit_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (topk_weights [T, k] float32, topk_ids [T, k]); computed in float32 as the checkpoints expect.
    ``bias``: V3's correction bias (steers the choice only); ``logit_bias``: gpt-oss's router bias."""
    logits = F.linear(x.float(), weight.float(), None if logit_bias is None else logit_bias.float())
    if cfg.scoring == "topk_softmax":
        top = logits.topk(cfg.top_k, dim=-1)
        return top.values.softmax(-1), top.indices
    scores = logits.softmax(-1) if cfg.scoring == "softmax" else logits.sigmoid()
    per_group = scores.shape[-1] // cfg.num_groups
    if cfg.topk_method == "noaux_tc":
        # V3: the bias steers the choice only; the weights are the unbiased scores.
        choice = scores + bias
        group_scores = choice.view(-1, cfg.num_groups, per_group).topk(2, dim=-1).values.sum(-1)
        choice = _mask_to_groups(choice, group_scores, cfg, float("-inf"))
    elif cfg.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, cfg.num_groups, per_group).amax(-1)
        choice = _mask_to_groups(scores, group_scores, cfg, 0.0)
    else:
        choice = scores
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.scaling, ids


class MoE(nn.Module):
    kernels = KernelChoice()  # set per model by DecoderLM.use_kernels

    def __init__(self, hidden: int, c: MoEConfig, fp8_block: tuple[int, int] | None = None,
                 tp: TensorParallel = TensorParallel()):
        """``fp8_block``: keep the routed experts in float8_e4m3fn with (bn x bk) block scales (DeepSeek-V3's
        checkpoint format) and run them as fp8 GEMMs; None = experts in the compute dtype. ``tp``: this rank holds
        routed experts [first_expert, first_expert + E / size) whole (expert parallel) and its share of the shared
        experts' width; the router is whole on every rank, so every rank routes every token the same way."""
        super().__init__()
        self.cfg = c
        inter, experts = c.intermediate_size, tp_split(c.num_experts, tp.size, "the routed experts")
        self.first_expert, self.tp_size = tp.rank * experts, tp.size
        self.gate_weight = nn.Parameter(torch.empty(c.num_experts, hidden), requires_grad=False)
        bias = torch.empty(c.num_experts) if self.cfg.topk_method == "noaux_tc" else None
        self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        dtype = torch.float8_e4m3fn if fp8_block else None
        self.gate_bias = nn.Parameter(torch.empty(c.num_experts), requires_grad=False) if c.router_bias else None
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype), requires_grad=False)
        if c.expert_bias:
            self.w_gate_up_bias = nn.Parameter(torch.empty(experts, 2 * inter), requires_grad=False)
            self.w_down_bias = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)
        self.fp8_block = fp8_block
        if fp8_block:
            bn, bk = fp8_block
            self.w_gate_up_scale = nn.Parameter(torch.empty(experts, -(-2 * inter // bn), -(-hidden // bk)),
                                                requires_grad=False)
            self.w_down_scale = nn.Parameter(torch.empty(experts, -(-hidden // bn), -(-inter // bk)),
                                             requires_grad=False)
        shared = c.num_shared_experts
        self.shared_experts = SwiGLU(hidden, tp_split(inter * shared, tp.size, "the shared experts' width")) \
            if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] (this rank's part of it under tensor parallelism: the layer all-reduces)."""
        weights, ids = route(x, self.gate_weight, self.e_score_correction_bias, self.cfg, self.gate_bias)
        if self.tp_size > 1:  # local expert indices; another rank's experts become E_local (fused_moe skips them)
            local = self.w_gate_up.shape[0]
            ids = ids - self.first_expert
            ids = ids.masked_fill((ids < 0) | (ids >= local), local)
        biases = (self.w_gate_up_bias, self.w_down_bias) if self.cfg.expert_bias else (None, None)
        scales = (self.w_gate_up_scale, self.w_down_scale, *self.fp8_block) if self.fp8_block else (None, None, 0, 0)
        experts = (x, self.w_gate_up, self.w_down, weights, ids, self.kernels.backend, *biases, self.cfg.swiglu_alpha,
                   self.cfg.swiglu_limit, *scales)
        if self.kernels.backend == "triton":  # under CUDA graphs, never traced: with its launch-config tuner
            out = run_routed_experts(*experts, tuner=self.kernels.moe_tuner)
        else:  # one opaque op, so that a compiled forward traces past the data-dependent expert loop
            out = routed_experts(*experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
