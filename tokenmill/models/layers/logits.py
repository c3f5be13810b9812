"""LM-head logits in float32 precision where it matters, at the cost of a 16-bit GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Leading candidates recomputed in float32. A 16-bit GEMM output is rounded (bf16: steps of 0.06 at a logit of
# 16), which can tie or swap the best candidates (the default model's first answer token flipped); a token outside
# the top 32 would need 32 others within two rounding steps of the maximum to matter.
REFINED_CANDIDATES = 32


def logits_with_exact_top(hidden: torch.Tensor, weight: torch.Tensor, head: nn.Module | None = None
                          ) -> torch.Tensor:
    """hidden [S, H], weight [V, H] -> float32 logits [S, V]; the top candidates equal a float32 GEMM's. ``head``:
    the layer that computes ``hidden @ weight.T`` (a packed one, kernels/cpu_linear.py); default ``F.linear``."""
    logits = (head(hidden) if head is not None else F.linear(hidden, weight)).float()
    if weight.dtype == torch.float32:
        return logits
    top = logits.topk(min(REFINED_CANDIDATES, logits.shape[-1]), dim=-1).indices  # [S, k]
    exact = torch.einsum("sh,skh->sk", hidden.float(), weight[top].float())
    return logits.scatter_(1, top, exact)
