"""Linear layers over quantized weights: the formats, the reference (dequantize, then matmul) and the dispatch.

A quantized weight W [N, K] is three tensors, named as a layer's buffers are (models/layers/linear.py):
- ``qweight``: int4: uint8 [N, K / 2], two 4-bit codes a byte; in each 32-input block of a row, byte j holds input
  j in its low nibble and input j + 16 in its high nibble (GGUF's Q4 order, kept so a GGUF tensor is copied, not
  repacked). int8: int8 [N, K]. fp8: float8_e4m3fn [N, K].
- ``scales``: [N, ceil(K / G)], one per group of G consecutive inputs (G = K: one per output channel; where G does
  not divide K the last group is shorter).
- ``mins`` (int4 always, int8 optionally): like ``scales``, the value of code 0: ``w = q * scale + min``.
So int4 and int8 are ``w = q * scale (+ min)`` and fp8 ``w = e4m3(q) * scale``. GGUF's Q4_0 is min = -8 d, Q4_1 is
scale d and min m, Q8_0 is int8 with groups of 32; AWQ/GPTQ's ``(q - z) * s`` is min = -z * s.

Format names (pure strings, so models/config.py names them without torch): ``<kind>-g<G>`` or ``<kind>-ch`` (one
group a row), plus ``-zp`` where mins are float32 (exact for an integer zero point times an fp16 scale; the fp16
mins of GGUF are exact as they are). Scales are fp16 (exact for GGUF, as shipped by AWQ/GPTQ), fp8's float32.

Dispatch: the C kernels on a CPU where they build: int4 / int8 on a host with AVX-512 VNNI or AVX2 in an
interleaved layout (``repack_x16``, kernels/cpu/quant_linear_x16.c: 16 (VNNI) or 8 (AVX2) output rows a register,
integer sums per 32-input block; with VNNI 2-5x the speed of the row-at-a-time kernel from 8 rows up:
benchmarks/results/quant-kernel-vnni.json; with AVX2 1.4-2.2x at one row but for the small 576x576 layer, 1.5-2.3x
at 16-32 rows: quant-kernel-avx2.json), elsewhere kernels/cpu/quant_linear.c (the weight bytes read once per call;
fp8 widened to float32 a tile at a time); fp8 W8A8 through ``torch._scaled_mm`` on GPUs with fp8 (compute
capability 8.9 and up: per-token dynamic fp8 activations); the reference elsewhere.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu_native import QuantWeight, X16Weight, library
from tokenmill.kernels.kv_write import FP8_DTYPE, FP8_MAX, MIN_SCALE, fp8_scale

KINDS = {"int4": 0, "int8": 1, "fp8": 2}
BLOCK = 32  # inputs per nibble block; every group size is a multiple of it


@dataclass(frozen=True)
class WeightFormat:
    kind: str  # "int4" | "int8" | "fp8"
    group_size: int  # inputs per scale; 0: one scale per output channel
    has_min: bool
    min_f32: bool = False

    @classmethod
    def parse(cls, name: str) -> "WeightFormat":
        parts = name.split("-")
        if len(parts) not in (2, 3) or parts[0] not in KINDS or parts[2:] not in ([], ["zp"]):
            raise ValueError(f"unknown weight format {name!r}")
        group = 0 if parts[1] == "ch" else int(parts[1][1:]) if parts[1][:1] == "g" and parts[1][1:].isdigit() else -1
        if group < 0 or group % BLOCK:
            raise ValueError(f"weight format {name!r}: the group size must be a multiple of {BLOCK} or 'ch'")
        kind = parts[0]
        if kind == "fp8" and parts[2:]:
            raise ValueError(f"weight format {name!r}: fp8 has no zero points")
        return cls(kind, group, has_min=kind == "int4" or bool(parts[2:]), min_f32=bool(parts[2:]))

    @property
    def name(self) -> str:
        return f"{self.kind}-{'ch' if not self.group_size else f'g{self.group_size}'}{'-zp' if self.min_f32 else ''}"

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.kind == "fp8" else torch.float16

    @property
    def min_dtype(self) -> torch.dtype:
        return torch.float32 if self.min_f32 else torch.float16

    def group(self, in_features: int) -> int:
        return self.group_size or in_features

    def check(self, out_features: int, in_features: int) -> None:
        if in_features % BLOCK:
            raise ValueError(f"format {self.name} needs the input width ({in_features}) to be a multiple of {BLOCK}")

    def groups(self, in_features: int) -> int:
        return -(-in_features // self.group(in_features))

    def shapes(self, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors of a [out, in] weight in this format: name -> (shape, dtype)."""
        self.check(out_features, in_features)
        groups = self.groups(in_features)
        q = {"int4": ((out_features, in_features // 2), torch.uint8), "int8": ((out_features, in_features), torch.int8),
             "fp8": ((out_features, in_features), FP8_DTYPE)}[self.kind]
        tensors = {"qweight": q, "scales": ((out_features, groups), self.scale_dtype)}
        if self.has_min:
            tensors["mins"] = ((out_features, groups), self.min_dtype)
        return tensors


# --- the reference

def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] in the 32-input block order above -> codes uint8 [N, K]."""
    blocks = qweight.view(qweight.shape[0], -1, BLOCK // 2)  # [N, K / 32, 16]
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).reshape(qweight.shape[0], -1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> uint8 [N, K / 2] (the inverse of ``unpack_int4``)."""
    blocks = codes.to(torch.uint8).view(codes.shape[0], -1, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def dequantize(fmt: WeightFormat, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
               ) -> torch.Tensor:
    """The weight [N, K] as float32: ``q * scale + min`` per group, each product and sum rounded once in float32."""
    q = unpack_int4(qweight) if fmt.kind == "int4" else qweight
    out_features, in_features = q.shape
    group = fmt.group(in_features)
    if in_features % group == 0:  # whole groups: each group's scale (and min) broadcast over its inputs
        w = q.reshape(out_features, -1, group).float() * scales.float()[..., None]
        if mins is not None:
            w = w + mins.float()[..., None]
        return w.view(out_features, in_features)
    w = q.float() * scales.float().repeat_interleave(group, dim=1)[:, :in_features]
    if mins is not None:
        w = w + mins.float().repeat_interleave(group, dim=1)[:, :in_features]
    return w


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """float32 [M, K] -> what the CPU kernel multiplies int4/int8 weights by: each 32-input block rounded to int8
    codes over its amax (``round(x * (127 / amax))``, half to even) times ``amax / 127``."""
    blocks = x.view(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor: ``127.0 / amax`` would be amax.reciprocal() * 127, another rounding (the kernel
    # divides, and a code at a rounding tie moves with the last bit).
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return ((blocks * inverse).round() * (amax / 127.0)).view_as(x)


def quant_linear_reference(x: torch.Tensor, fmt: WeightFormat, qweight: torch.Tensor, scales: torch.Tensor,
                           mins: torch.Tensor | None, bias: torch.Tensor | None = None,
                           int8_activations: bool = False) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, computed in float32 over the dequantized weight; with
    ``int8_activations`` (what the CPU kernel does for int4/int8 weights) over ``quantize_activations(x)``."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if int8_activations and fmt.kind != "fp8":
        rows = quantize_activations(rows)
    out = F.linear(rows, dequantize(fmt, qweight, scales, mins), None if bias is None else bias.float())
    return out.view(*x.shape[:-1], -1).to(x.dtype)


# --- round to nearest, per channel / per group (--quantization)

def quantize(weight: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """float [N, K] -> this format's tensors, rounded to nearest: int8 symmetric (scale = amax / 127), int4
    asymmetric over each group's [min, max] (scale = (max - min) / 15), fp8 per channel (scale = amax / 448). The
    scales (and mins) are rounded to their stored dtype before the codes are chosen, so each code is the nearest for
    the stored grid."""
    out_features, in_features = weight.shape
    fmt.check(out_features, in_features)
    group = fmt.group(in_features)
    pad = fmt.groups(in_features) * group - in_features  # a short last group, padded with its own last input
    padded = F.pad(weight.float()[None], (0, pad), mode="replicate")[0] if pad else weight.float()
    w = padded.view(out_features, -1, group)  # [N, groups, G]
    if fmt.kind == "fp8":
        scale = fp8_scale(w.abs().amax(dim=(1, 2)))[:, None]  # [N, 1]
        return {"qweight": (weight.float() / scale).to(FP8_DTYPE), "scales": scale.expand(-1, w.shape[1]).contiguous()}
    if fmt.kind == "int8":
        scale = (w.abs().amax(dim=-1) / 127).clamp(min=MIN_SCALE).to(fmt.scale_dtype)
        codes = (w / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8).view(out_features, -1)
        codes = codes[:, :in_features].contiguous()
        tensors = {"qweight": codes, "scales": scale}
        if fmt.has_min:
            tensors["mins"] = torch.zeros_like(scale, dtype=fmt.min_dtype)
        return tensors
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=MIN_SCALE).to(fmt.scale_dtype)
    low = low.to(fmt.min_dtype)
    codes = ((w - low.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15).view(out_features, -1)
    codes = codes[:, :in_features].contiguous()
    return {"qweight": pack_int4(codes), "scales": scale, "mins": low}


# --- the dispatch

def quant_linear(x: torch.Tensor, fmt: WeightFormat, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, bias: torch.Tensor | None = None, backend: str = "torch") -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: the kernel for this device, format and resolved kernel ``backend``
    ("cpu": the C kernel; kernels/backend.py), else the reference (weight-only: float activations)."""
    if backend == "cpu" and x.device.type == "cpu" and library() is not None:
        return quant_linear_cpu(x, fmt, qweight, scales, mins, bias)
    if fmt.kind == "fp8" and not fmt.group_size and x.device.type == "cuda" \
            and torch.cuda.get_device_capability(x.device) >= (8, 9):
        return fp8_w8a8_linear(x, qweight, scales, bias)
    return quant_linear_reference(x, fmt, qweight, scales, mins, bias)


X16_ROWS = 16  # output rows of one register in the interleaved layout (kernels/cpu/quant_linear_x16.c)


def repack_x16(fmt: WeightFormat, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An int4 / int8 weight [N, K] -> kernels/cpu/quant_linear_x16.c's interleaved layout (its header has the
    bytes): codes uint8 [tiles, K / 32, 8, 32 (int4) | 64 (int8)], scales and mins [tiles, groups, 16] (float16 as
    given, else float32; mins None where the format has none); rows padded to a multiple of 16 with zeros. Lossless:
    the same codes, scales and mins in another order (int8 codes + 128), the same bytes where 16 divides N."""
    codes = unpack_int4(qweight) if fmt.kind == "int4" else (qweight.to(torch.int16) + 128).to(torch.uint8)
    rows, inputs = codes.shape
    tiles, blocks = -(-rows // X16_ROWS), inputs // BLOCK

    def tiled(values: torch.Tensor) -> torch.Tensor:  # [N, C] -> [tiles, 16, C], zero rows appended
        out = values.new_zeros(tiles * X16_ROWS, values.shape[1])
        out[:rows] = values
        return out.view(tiles, X16_ROWS, -1)

    steps = tiled(codes).view(tiles, X16_ROWS, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [tiles, block, step, row, 4]
    if fmt.kind == "int4":
        q = (steps[:, :, :, :8] | (steps[:, :, :, 8:] << 4)).reshape(tiles, blocks, 8, 32)
    else:
        q = steps.reshape(tiles, blocks, 8, 64)

    def per_group(values: torch.Tensor) -> torch.Tensor:
        dtype = values.dtype if values.dtype in (torch.float16, torch.float32) else torch.float32
        return tiled(values.to(dtype)).transpose(1, 2).contiguous()

    return q.contiguous(), per_group(scales), per_group(mins) if mins is not None else None


def unpack_x16(fmt: WeightFormat, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
               out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``repack_x16``'s inverse: the canonical (qweight, scales, mins) of a weight of ``out_features`` rows."""
    tiles, blocks = q.shape[:2]
    if fmt.kind == "int4":
        steps = torch.cat((q & 0x0F, q >> 4), dim=-1).view(tiles, blocks, 8, X16_ROWS, 4)
    else:
        steps = q.view(tiles, blocks, 8, X16_ROWS, 4)
    codes = steps.permute(0, 3, 1, 2, 4).reshape(tiles * X16_ROWS, blocks * BLOCK)[:out_features]
    qweight = pack_int4(codes) if fmt.kind == "int4" else (codes.to(torch.int16) - 128).to(torch.int8)

    def untiled(values: torch.Tensor) -> torch.Tensor:
        return values.transpose(1, 2).reshape(tiles * X16_ROWS, -1)[:out_features].contiguous()

    return qweight, untiled(scales), untiled(mins) if mins is not None else None


def is_symmetric(fmt: WeightFormat, scales: torch.Tensor, mins: torch.Tensor | None) -> bool:
    """Whether every weight is ``scale * (q - 8)`` (int4 whose mins are all -8 * scale, as GGUF's Q4_0 writes them)
    or ``scale * q`` (int8 without mins, or with all of them 0): the interleaved kernel then takes the zero point off
    in integers and skips the min term (kernels/cpu/quant_linear_x16.c)."""
    if fmt.kind == "int4":
        return mins is not None and torch.equal(mins.float(), scales.float() * -8)  # exact: a power of two
    if fmt.kind == "int8":
        return mins is None or not bool(mins.any())
    return False


def default_tile_rows(out_features: int, threads: int) -> int:
    """Output rows a thread widens at once: 16 (more reuse of each row of x) while every thread still gets four
    tiles, else 4."""
    return 16 if out_features >= 16 * 4 * threads else 4


class CPUQuantMatmul:
    """The C kernel over one weight, its constant arguments prepared once (a decode step makes over a hundred of
    these calls; building them per call cost ~30 us each). The weight tensors must stay where they are.

    On a host whose build has AVX-512 VNNI or AVX2 (``x16_available``), int4 / int8 weights run in the interleaved
    layout: given canonical tensors, the kernel keeps a repacked copy; ``repacked_rows=N`` says they are
    ``repack_x16``'s already, of a weight of N rows (a layer that holds its weight that way). On a host with AMX
    (``amx_available``), calls of ``amx_from_rows`` rows and more (0: none) run on its tiles: bf16 activations, not
    int8 (engine/quant_layouts.py measures where that pays)."""

    def __init__(self, fmt: WeightFormat, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None = None, tile_rows: int = 0, repacked_rows: int | None = None,
                 interleaved: bool = True, amx_from_rows: int = 0):
        lib = library()
        if lib is None:
            raise RuntimeError("the CPU kernels are not built (kernels/cpu_native.py logged why)")
        self.fmt = fmt
        bias32 = bias.float().contiguous() if bias is not None else None
        # interleaved=False: the row-at-a-time kernel even where the interleaved one runs (benchmarks compare them)
        if repacked_rows is not None or (interleaved and fmt.kind != "fp8" and lib.tm_x16_register_rows()):
            if repacked_rows is None:
                repacked_rows = qweight.shape[0]
                qweight, scales, mins = repack_x16(fmt, qweight, scales, mins)
            self.in_features, self.out_features = qweight.shape[1] * BLOCK, repacked_rows
            self._keep = (qweight, scales, mins, bias32)
            self._weight = X16Weight(
                q=qweight.data_ptr(), d=scales.data_ptr(), m=mins.data_ptr() if mins is not None else None,
                K=self.in_features, N=self.out_features, G=fmt.group(self.in_features), kind=KINDS[fmt.kind],
                d_f32=int(scales.dtype == torch.float32), m_f32=int(mins is not None and mins.dtype == torch.float32),
                amx_from_rows=amx_from_rows, symmetric=int(is_symmetric(fmt, scales, mins)))
            x16_fn, bias_ptr = lib.tm_quant_linear_x16, bias32.data_ptr() if bias32 is not None else None
            self._fn = lambda weight, x, rows, out, bf16=0: x16_fn(weight, x, rows, bias_ptr, out, bf16)
            self._bf16_io = True
            # what kernels/cpu/decoder.c calls tm_quant_linear_x16 with: this weight's handle and float32 bias
            self.weight_address, self.bias_address = ctypes.addressof(self._weight), bias_ptr
        else:
            self.in_features = qweight.shape[1] * 2 if fmt.kind == "int4" else qweight.shape[1]
            self.out_features = qweight.shape[0]
            self._keep = (qweight, scales, mins, bias32)
            self._fn = lib.tm_quant_linear_prepared
            self._bf16_io = False
            self.weight_address = self.bias_address = None  # the row-at-a-time kernel: not decoder.c's
            self._weight = QuantWeight(
                q=qweight.data_ptr(), scales=scales.data_ptr(), mins=mins.data_ptr() if mins is not None else None,
                bias=bias32.data_ptr() if bias32 is not None else None, K=self.in_features, N=self.out_features,
                G=fmt.group(self.in_features), tile_rows=tile_rows or default_tile_rows(self.out_features,
                                                                                       torch.get_num_threads()),
                scales_f32=int(scales.dtype == torch.float32),
                mins_f32=int(mins is not None and mins.dtype == torch.float32), kind=KINDS[fmt.kind])
        self._weight_ref = ctypes.byref(self._weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (any float dtype; computed in float32) -> [..., N] in x's dtype."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        # the interleaved kernel reads and writes bf16 itself (no conversion ops, each ~10 us inside a step)
        bf16 = rows.dtype is torch.bfloat16 and self._bf16_io and rows.is_contiguous()
        if not bf16 and (rows.dtype is not torch.float32 or not rows.is_contiguous()):
            rows = rows.float().contiguous()
        out = rows.new_empty((rows.shape[0], self.out_features))
        code = self._fn(self._weight_ref, rows.data_ptr(), rows.shape[0], out.data_ptr(), *((1,) if bf16 else ()))
        if code != 0:
            raise RuntimeError(f"tm_quant_linear failed ({code}) for a {self.fmt.name} weight "
                               f"[{self.out_features}, {self.in_features}]")
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        return out if out.dtype is x.dtype else out.to(x.dtype)


def quant_linear_cpu(x: torch.Tensor, fmt: WeightFormat, qweight: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor | None, bias: torch.Tensor | None = None, tile_rows: int = 0) -> torch.Tensor:
    """The C kernel: x [..., K] (any float dtype; computed in float32) -> [..., N] in x's dtype."""
    return CPUQuantMatmul(fmt, qweight, scales, mins, bias, tile_rows)(x)


def fp8_w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    """fp8 weights [N, K] with per-channel float32 scales (every group of a row equal) times activations quantized
    to fp8 per token (amax / 448), through ``torch._scaled_mm`` (cuBLASLt's fp8 GEMM on Hopper, oneDNN on a CPU)."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)  # [M, 1]
    x_q = (rows.float() / x_scale).to(FP8_DTYPE)
    w_scale = scales[:, :1].float().t().contiguous()  # [1, N]
    if x.device.type == "cuda":
        out = torch._scaled_mm(x_q, qweight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.float32)
    else:  # oneDNN's _scaled_mm takes only per-tensor scales (torch > 2.13 checks it): row and column scales after
        one = torch.ones((), device=x.device)
        out = torch._scaled_mm(x_q, qweight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32) * x_scale * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.view(*x.shape[:-1], qweight.shape[0]).to(x.dtype)
