"""Mixture-of-experts FFN: route each token to top-k experts, run SwiGLU experts, sum the weighted outputs.

Shapes: ``x[T, H]``; ``w_gate_up[E, 2I, H]`` (rows: gate then up, as HF stores fused experts);
``w_down[E, H, I]``; ``topk_weights[T, k]`` float32 and ``topk_ids[T, k]`` int64 from the router.
Output ``[T, H]`` in x's dtype: ``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
``e = topk_ids[t, j]``. Experts that get no tokens cost nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The spec (and the CPU path): a readable loop over the experts that received tokens."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    intermediate = w_down.shape[-1]
    for expert in topk_ids.unique().tolist():
        token_idx, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[token_idx], w_gate_up[expert]).split(intermediate, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[expert])
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    return fused_moe_reference(x, w_gate_up, w_down, topk_weights, topk_ids)
