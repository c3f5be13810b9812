"""fp8 weights and activations in DeepSeek-V3's layout (references; the CPU path and the spec of the Triton code).

Weights: float8_e4m3fn ``[N, K]`` with float32 ``scale_inv[ceil(N / bn), ceil(K / bk)]``, one per (bn x bk) block
(128 x 128 in the released checkpoints): ``w ~= float(w_q) * scale_inv[n // bn, k // bk]``.
Activations: quantized per token and group of ``group`` consecutive features (``group = bk``), so each
(token, k-block) product of a GEMM needs only two scalars: ``x ~= float(x_q) * x_scale[t, k // group]``.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_write import FP8_DTYPE, fp8_scale


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [..., N, K] with float32 scales [..., ceil(N / bn), ceil(K / bk)] -> float32 [..., N, K]."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
    return weight.float() * scale[..., :cols]


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (fp8 [..., N, K], float32 scale_inv [..., ceil(N / bn), ceil(K / bk)]); amax / 448."""
    rows, cols = weight.shape[-2:]
    bn, bk = block
    pad_rows, pad_cols = -rows % bn, -cols % bk
    padded = torch.nn.functional.pad(weight.float(), (0, pad_cols, 0, pad_rows))
    blocks = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., N/bn, bn, K/bk, bk]
    scale = fp8_scale(blocks.abs().amax(dim=(-3, -1)))  # [..., N/bn, K/bk]
    full = scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :rows, :cols]
    return (weight.float() / full).to(FP8_DTYPE), scale


def per_token_group_quant_fp8_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (fp8 [M, K], float32 [M, ceil(K / group)]) with scale = amax / 448 of each group."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -cols % group)).view(rows, -1, group)
    scale = fp8_scale(padded.abs().amax(dim=-1))
    return (padded / scale[..., None]).to(FP8_DTYPE).view(rows, -1)[:, :cols], scale


def per_token_group_quant_fp8(x: torch.Tensor, group: int, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: ``backend`` is a resolved kernel backend, "triton" or "torch" (kernels/backend.py)."""
    if backend == "triton":
        from tokenmill.kernels.triton.fp8_quant import per_token_group_quant_fp8_triton

        return per_token_group_quant_fp8_triton(x, group)
    return per_token_group_quant_fp8_reference(x, group)
