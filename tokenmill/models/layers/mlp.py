from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.gated_activation import silu_mul  # also registers torch.ops.tokenmill.silu_mul

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection (rows [gate | up]); ``act`` SiLU
    (SwiGLU) or GELU-tanh (Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu"):
        super().__init__()
        self.intermediate = intermediate
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.kernels = KernelChoice()  # set by the model (DecoderLM.use_kernels)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu" and self.kernels.backend == "cpu" and x.device.type == "cpu":
            return self.down_proj(self._c_gated(x))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def _c_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up through the C kernel (kernels/gated_activation.py). Compiled, it is an op inductor leaves
        alone: fused with the projection where that is a layer of the CPU table (kernels/cpu_linear.py; such layers
        carry ``index``), else an op of its own."""
        proj = self.gate_up_proj
        if not torch.compiler.is_compiling():
            return silu_mul(proj(x))
        if type(proj) is not nn.Linear and hasattr(proj, "index"):
            return torch.ops.tokenmill.cpu_linear_silu_mul(x, proj.index, self.intermediate)
        return torch.ops.tokenmill.silu_mul(proj(x))
