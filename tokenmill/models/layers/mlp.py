from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection (rows [gate | up]); ``act`` SiLU
    (SwiGLU) or GELU-tanh (Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu"):
        super().__init__()
        self.intermediate = intermediate
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)
