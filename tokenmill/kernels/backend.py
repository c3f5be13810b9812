"""Which implementation of the kernels a model runs: ``triton`` (the kernels in ``kernels/triton/``) or ``torch``
(the PyTorch references). Resolved once when the model is built, from ``EngineConfig.kernel_backend``:
``auto`` = Triton on CUDA, PyTorch elsewhere. ``triton`` on a CPU is allowed only under Triton's interpreter
(``TRITON_INTERPRET=1``), where it runs the real kernels slowly: the way they are proven without a GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("auto", "triton", "torch")


def _triton_runs_on(device: torch.device) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    from tokenmill.kernels.triton.common import dot, interpreting

    if device.type == "cuda" or interpreting(dot):
        return True, ""
    return False, f"Triton kernels need a CUDA device (got {device.type}); on a CPU set TRITON_INTERPRET=1 to " \
                  "run them through Triton's interpreter, slowly"


def resolve_kernel_backend(name: str, device: torch.device) -> str:
    """-> "triton" | "torch"; ValueError when ``triton`` is asked for where it cannot run."""
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_runs_on(device)[0] else "torch"
    ok, why = _triton_runs_on(device)
    if not ok:
        raise ValueError(f"kernel_backend=triton: {why}")
    return "triton"


@dataclass(frozen=True)
class KernelChoice:
    """What the layers that call kernels use: a resolved backend and, for the Triton fused MoE, an optional tuner
    (``kernels.triton.moe_config.MoETuner``; None = heuristic launch configs)."""
    backend: str = "torch"  # "triton" | "torch"
    moe_tuner: Any = None
