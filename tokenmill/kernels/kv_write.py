"""Write new K/V (or MLA latents) into the paged cache, quantizing to fp8 with per-(token, slot) scales.

Cache layout (see kvcache/spec.py): ``data[num_blocks + 1, block_size, num_slots, slot_dim]`` and, for fp8,
``scales[num_blocks + 1, block_size, num_slots]`` float32 with ``value ~= float(data) * scale``. The last
block is the *null block*: always zero, never handed out, the target of every padded read.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
MIN_SCALE = 1e-12  # an all-zero vector gets a tiny scale, never a division by zero
# fp8_bits_as_fp16(x) == float(x) / FP8_TO_FP16_FACTOR for every finite e4m3fn x (normal and subnormal).
FP8_TO_FP16_FACTOR = 256.0


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 (at least MIN_SCALE), IEEE-divided on every device, as the Triton quantizers do (div_rn).

    The divisor is a tensor on amax's device: PyTorch's CUDA division by a Python scalar multiplies by its
    reciprocal, which is one unit in the last place off the quotient for some amax."""
    return (amax / amax.new_full((), FP8_MAX)).clamp(min=MIN_SCALE)


def quantize_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (fp8 [..., D], float32 scales [...]) with one scale per vector."""
    values = values.float()
    scale = fp8_scale(values.abs().amax(dim=-1))
    return (values / scale.unsqueeze(-1)).to(FP8_DTYPE), scale


def fp8_bits_as_fp16(data: torch.Tensor) -> torch.Tensor:
    """Reinterpret e4m3fn bits (s eeee mmm, bias 7) as fp16 (s eeeee mmmmmmmmmm, bias 15) with integer ops.

    Moving the exponent and mantissa into fp16's fields gives the value times 2^-8 (the bias gap), exactly,
    for normals and subnormals alike. torch's own fp8 -> float cast is scalar on CPU; this is ~3x faster.
    """
    bits = data.view(torch.uint8).to(torch.int16)
    return (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).view(torch.float16)


def dequantize(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of the cache's storage: fp8 * scale, or a plain cast for 16/32-bit caches."""
    if scales is None:
        return data.to(dtype)
    values = fp8_bits_as_fp16(data).to(dtype if dtype != torch.float16 else torch.float32)
    return (values * (scales * FP8_TO_FP16_FACTOR).unsqueeze(-1)).to(dtype)


def write_kv_reference(data: torch.Tensor, scales: torch.Tensor | None, new: torch.Tensor,
                       slot_mapping: torch.Tensor, padded: bool | None = None) -> None:
    """Scatter ``new`` [T, num_slots, slot_dim] into the cache at flat slots ``slot_mapping`` [T]; a negative slot
    (a padding row of a CUDA-graph batch) writes nothing. ``padded``: whether any slot is negative, where the caller
    knows it (once per step); None: looked up here."""
    num_slots, slot_dim = data.shape[-2:]
    flat = data.view(-1, num_slots, slot_dim)
    if padded if padded is not None else bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        new, slot_mapping = new[keep], slot_mapping[keep]
    if scales is None:
        flat[slot_mapping] = new.to(data.dtype)
        return
    quantized, scale = quantize_fp8(new)
    flat[slot_mapping] = quantized
    scales.view(-1, num_slots)[slot_mapping] = scale


def write_kv(data: torch.Tensor, scales: torch.Tensor | None, new: torch.Tensor, slot_mapping: torch.Tensor,
             backend: str = "torch", padded: bool | None = None) -> None:
    """Dispatch: ``backend`` is a resolved kernel backend, "triton" or "torch" (kernels/backend.py)."""
    if backend == "triton":
        from tokenmill.kernels.triton.kv_write import write_kv_triton

        write_kv_triton(data, scales, new, slot_mapping)
    else:
        write_kv_reference(data, scales, new, slot_mapping, padded)
