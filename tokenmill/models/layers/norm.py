from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """``offset`` 1.0: Gemma's RMSNorm, which scales by (1 + weight) (its checkpoints store weight - 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim]; computed in float32 as transformers does, returned in x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: scaled in float32, then cast
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)
