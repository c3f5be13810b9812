"""Routed experts of the GQA MoE families as their checkpoints store them -> MoE's [E, 2I, H] (rows [gate | up])
and [E, H, I] layouts (models/layers/moe.py):

- per expert (Qwen3-MoE, GLM-4.5): ``mlp.experts.{e}.{gate,up,down}_proj.weight``;
- fused (gpt-oss, transformers 5): ``mlp.experts.gate_up_proj`` [E, H, 2I] with gate and up *interleaved* along
  the last dimension (gate = [..., 0::2]), ``gate_up_proj_bias`` [E, 2I] likewise, ``down_proj`` [E, I, H] and
  ``down_proj_bias`` [E, H];
- MXFP4 (gpt-oss as released, quantization_config.quant_method "mxfp4"): ``{gate_up,down}_proj_blocks``
  [E, rows, cols / 32, 16] uint8, two e2m1 codes per byte (low nibble first), and ``_scales`` [E, rows, cols / 32]
  uint8, one e8m0 exponent (bias 127) per 32 values, rows being the output features (gate/up interleaved):
  dequantized here at load (no MXFP4 kernel yet).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

# e2m1 code -> value (the OCP microscaling spec's FP4).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PER_EXPERT = re.compile(r"(.+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
FUSED = re.compile(r"(.+\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias)?")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 codes, [..., G] uint8 exponents -> [..., G * 32] float32."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-3)  # [..., G * 32]
    exponents = (scales.long() - 127).repeat_interleave(32, dim=-1)
    return torch.ldexp(values, exponents)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate/up interleaved along ``dim`` -> [gate | up]."""
    n = t.shape[dim]
    return torch.cat([t.index_select(dim, torch.arange(0, n, 2)), t.index_select(dim, torch.arange(1, n, 2))], dim)


def fused_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's fused (or MXFP4) expert tensors -> ``<mlp>.w_gate_up`` [E, 2I, H], ``<mlp>.w_gate_up_bias``
    [E, 2I], ``<mlp>.w_down`` [E, H, I], ``<mlp>.w_down_bias`` [E, H]; every other tensor passes through. MXFP4
    blocks wait for their scales (any order)."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(("_proj_blocks", "_proj_scales")):
            base, kind = name.rsplit("_", 1)
            other = pending.pop(f"{base}_{'scales' if kind == 'blocks' else 'blocks'}", None)
            if other is None:
                pending[name] = tensor
                continue
            blocks, scales = (tensor, other) if kind == "blocks" else (other, tensor)
            dense = dequantize_mxfp4(blocks, scales)  # [E, out, in]: rows are output features
            prefix, proj = base.rsplit(".experts.", 1)
            if proj == "gate_up_proj":
                yield f"{prefix}.w_gate_up", _deinterleave(dense, 1)
            else:
                yield f"{prefix}.w_down", dense
            continue
        m = FUSED.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        prefix, proj, bias = m.groups()
        if proj == "gate_up_proj":
            yield (f"{prefix}.w_gate_up_bias", _deinterleave(tensor, 1)) if bias else \
                (f"{prefix}.w_gate_up", _deinterleave(tensor.transpose(1, 2), 1))
        else:
            yield (f"{prefix}.w_down_bias", tensor) if bias else (f"{prefix}.w_down", tensor.transpose(1, 2))
    if pending:
        raise ValueError(f"MXFP4 blocks without their scales (or scales without blocks): {sorted(pending)[:3]}")
