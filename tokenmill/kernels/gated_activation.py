"""SwiGLU's gated activation, silu(gate) * up, over a fused [gate | up] projection's output: the C kernel of
kernels/cpu/gated_activation.c on a CPU where the kernels build, else PyTorch (the reference). Registered as the op
``tokenmill::silu_mul`` so that a compiled graph calls the C kernel where inductor would otherwise generate its own
loop (~5x slower per element on a Zen 4: its exp and division)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu_native import library


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> [..., I]: silu(gate) * up in float32, rounded once to the input's dtype (what inductor's fused
    code computes)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] -> [..., I] (bf16 or float32 on a CPU through the C kernel; anything else through the reference)."""
    lib = library() if gate_up.device.type == "cpu" else None
    if lib is None or gate_up.dtype not in (torch.bfloat16, torch.float32) or gate_up.shape[-1] % 2 \
            or gate_up.numel() == 0:
        return silu_mul_reference(gate_up)
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
    lib.tm_silu_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], inter,
                    int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    return out


# A plain CPU kernel registration (torch.library.Library), as cpu_linear's: custom_op's Python wrapper costs more per
# call than this whole op at decode sizes.
_library = torch.library.Library("tokenmill", "FRAGMENT")
_library.define("silu_mul(Tensor gate_up) -> Tensor")
_library.impl("silu_mul", silu_mul, "CPU")


@torch.library.register_fake("tokenmill::silu_mul")
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
