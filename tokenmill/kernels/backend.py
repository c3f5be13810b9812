"""Which implementation of the kernels a model runs: ``triton`` (the kernels in ``kernels/triton/``), ``cpu`` (the
C kernels of ``kernels/cpu/``, built for the host at first use, where a kernel has one; the PyTorch references
otherwise) or ``torch`` (the PyTorch references). Resolved once when the model is built, from
``EngineConfig.kernel_backend``: ``auto`` = Triton on CUDA, the C kernels on a CPU where they build (else PyTorch). ``triton`` on a CPU is allowed only under Triton's interpreter
(``TRITON_INTERPRET=1``), where it runs the real kernels slowly: the way they are proven without a GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("auto", "triton", "cpu", "torch")


# float8_e4m3 in Triton kernels (loads, stores, tl.dot) needs compute capability 8.9 (Ada) or newer.
FP8_MIN_CAPABILITY = (8, 9)


def _triton_runs_on(device: torch.device, fp8: bool) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    from tokenmill.kernels.triton.common import dot, interpreting

    if interpreting(dot):
        return True, ""
    if device.type != "cuda":
        return False, f"Triton kernels need a CUDA device (got {device.type}); on a CPU set TRITON_INTERPRET=1 to " \
                      "run them through Triton's interpreter, slowly"
    capability = torch.cuda.get_device_capability(device)
    if fp8 and capability < FP8_MIN_CAPABILITY:
        return False, f"the fp8 KV cache / fp8 weights need compute capability >= 8.9 in Triton (this GPU is " \
                      f"{capability[0]}.{capability[1]}); use --kv-cache-dtype bf16 or --kernel-backend torch"
    return True, ""


def _cpu_kernels_build() -> bool:
    from tokenmill.kernels.cpu_native import library

    return library() is not None


def resolve_kernel_backend(name: str, device: torch.device, fp8: bool = False) -> str:
    """-> "triton" | "cpu" | "torch"; ValueError when ``triton`` or ``cpu`` is asked for where it cannot run.
    ``fp8``: the model uses an fp8 KV cache or fp8 weights. ``auto`` picks Triton or the C kernels only where they
    run."""
    if name not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"kernel_backend=cpu: the C kernels run on a CPU (got {device.type})")
        if not _cpu_kernels_build():
            raise ValueError("kernel_backend=cpu: the C kernels did not build here (the log says why)")
        return "cpu"
    if name == "auto":
        if device.type == "cuda":
            return "triton" if _triton_runs_on(device, fp8)[0] else "torch"
        return "cpu" if device.type == "cpu" and _cpu_kernels_build() else "torch"
    ok, why = _triton_runs_on(device, fp8)
    if not ok:
        raise ValueError(f"kernel_backend=triton: {why}")
    return "triton"


@dataclass(frozen=True)
class KernelChoice:
    """What the layers that call kernels use: a resolved backend and, for the Triton fused MoE, an optional tuner
    (``kernels.triton.moe_config.MoETuner``; None = heuristic launch configs)."""
    backend: str = "torch"  # "triton" | "cpu" | "torch"
    moe_tuner: Any = None
