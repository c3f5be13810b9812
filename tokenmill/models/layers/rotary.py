"""Rotary position embeddings with the scaling kinds HF configs name: default, linear, llama3, yarn.

``inv_freq[rot_dim / 2]`` follows transformers' ``modeling_rope_utils``; yarn also scales cos/sin by an
attention factor. ``apply`` rotates the first ``rot_dim`` features in the neox / HF ``rotate_half`` layout
(pairs are (i, i + rot_dim/2)).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tokenmill.kernels.rotary import rope_qk, rotate_reference  # also registers torch.ops.tokenmill.rope_qk


def _default(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, p: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    original = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables are built on the CPU (explicitly, so a meta-device model build leaves them real)."""

    def __init__(self, rot_dim: int, max_position: int, params: dict[str, Any]):
        base, kind = params["rope_theta"], params["rope_type"]
        attention_factor = 1.0
        if kind == "default":
            inv_freq = _default(base, rot_dim)
        elif kind == "linear":
            inv_freq = _default(base, rot_dim) / params["factor"]
        elif kind == "llama3":
            inv_freq = _llama3(_default(base, rot_dim), params)
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn(base, rot_dim, params, max_position)
        else:
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")
        self.rot_dim = rot_dim
        self.params = params
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cpu"), inv_freq)  # [P, rot_dim/2]
        self.cos = freqs.cos() * attention_factor
        self.sin = freqs.sin() * attention_factor

    def to(self, device: torch.device | str) -> "RotaryEmbedding":
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (D >= rot_dim), positions [T] -> rotated copy in x's dtype."""
        return rotate_reference(x, positions, self.cos, self.sin)

    def apply_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``apply`` to a step's queries and keys; with the "cpu" kernel backend on a CPU, both in one C call (compiled:
        the op ``tokenmill::rope_qk``, which inductor leaves alone)."""
        if backend != "cpu" or q.device.type != "cpu":
            return self.apply(q, positions), self.apply(k, positions)
        if torch.compiler.is_compiling():
            return torch.ops.tokenmill.rope_qk(q, k, positions, self.cos, self.sin)
        return rope_qk(q, k, positions, self.cos, self.sin)
