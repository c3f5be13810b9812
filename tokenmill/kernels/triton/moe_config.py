"""Launch configurations for the fused-MoE kernel: a heuristic that covers any (experts, N, K, batch), and a tuner
that measures candidates once per shape on the GPU at hand and keeps the winner in a JSON file, so no per-GPU
table has to ship (and no "default config" warning exists to be ignored).

A shape's key buckets the token count to a power of two: one measurement serves a range of batch sizes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from triton.runtime.errors import OutOfResources

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoEShape:
    tokens: int
    experts: int
    inter: int  # I: N of the gate/up GEMM (each half), K of the down GEMM
    hidden: int  # H
    top_k: int
    dtype: str  # of the expert weights: "bfloat16", "float8_e4m3fn", ...
    block: tuple[int, int] | None  # fp8 weight block (bn, bk), None for 16/32-bit weights

    def key(self) -> str:
        bucket = 1 << max(0, (self.tokens - 1).bit_length())
        block = "x".join(map(str, self.block)) if self.block else "none"
        return (f"E={self.experts},I={self.inter},H={self.hidden},k={self.top_k},dtype={self.dtype},"
                f"block={block},tokens<={bucket}")


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def fitted(self, shape: MoEShape) -> "MoEConfig":
        """Tiles no wider than the problem (>= 16 for tensor cores); with fp8, BLOCK_K divides the scale block."""
        def fit(block: int, size: int) -> int:
            return max(16, min(block, 1 << max(0, (size - 1).bit_length())))
        block_n = fit(self.block_n, min(shape.inter, shape.hidden))
        block_k = fit(self.block_k, min(shape.inter, shape.hidden))
        if shape.block is not None:
            while shape.block[1] % block_k and block_k > 16:
                block_k //= 2
            if shape.block[1] % block_k:
                raise ValueError(f"fp8 scale block {shape.block} needs a K block of at least 16 dividing it")
        return MoEConfig(self.block_m, block_n, block_k, self.group_m, self.num_warps, self.num_stages)


def heuristic_config(shape: MoEShape) -> MoEConfig:
    """By the average rows an expert gets: small M tiles when each expert sees a few tokens (decode: the GEMMs
    are weight-bound, every padded row is wasted work), large ones for prefill batches (compute-bound)."""
    rows_per_expert = shape.tokens * shape.top_k / shape.experts
    if rows_per_expert <= 8:
        cfg = MoEConfig(16, 64, 128, 1, 4, 4)
    elif rows_per_expert <= 32:
        cfg = MoEConfig(32, 64, 128, 8, 4, 3)
    elif rows_per_expert <= 96:
        cfg = MoEConfig(64, 128, 64, 8, 4, 3)
    else:
        cfg = MoEConfig(128, 128, 64, 8, 8, 3)
    return cfg.fitted(shape)


def candidate_configs(shape: MoEShape) -> list[MoEConfig]:
    """The search space of the tuner, fitted to the shape and deduplicated (M tiles beyond 4x the average rows
    an expert gets are skipped: they are mostly padding)."""
    rows = max(16, 4 * shape.tokens * shape.top_k // shape.experts)
    space = itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128), (1, 8), (4, 8), (3, 4))
    fitted = {MoEConfig(*c).fitted(shape) for c in space if c[0] <= rows}
    return sorted(fitted, key=lambda c: tuple(asdict(c).values()))


def _time_cuda(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=20)


def _time_host(fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


class MoETuner:
    """``config(shape, run, device)``: the fastest candidate for the shape's key on this device, measured on first
    use by calling ``run(candidate)`` under ``timer`` (ms), then read back from ``directory`` for ever after."""

    def __init__(self, directory: Path, timer: Callable[[Callable[[], object]], float] | None = None,
                 candidates: Callable[[MoEShape], list[MoEConfig]] = candidate_configs):
        self.directory = Path(directory)
        self.timer = timer
        self.candidates = candidates
        self._tables: dict[Path, dict[str, dict]] = {}

    def _file(self, device: torch.device) -> Path:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
        return self.directory / f"fused_moe-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.json"

    def _table(self, path: Path) -> dict[str, dict]:
        if path not in self._tables:
            self._tables[path] = json.loads(path.read_text()) if path.exists() else {}
        return self._tables[path]

    def config(self, shape: MoEShape, run: Callable[[MoEConfig], object], device: torch.device) -> MoEConfig:
        path = self._file(device)
        table = self._table(path)
        if shape.key() in table:
            return MoEConfig(**table[shape.key()])
        timer = self.timer or (_time_cuda if device.type == "cuda" else _time_host)
        candidates = self.candidates(shape)
        log.info("tuning fused MoE for %s: %d candidate configs", shape.key(), len(candidates))
        timings = []
        for candidate in candidates:
            try:
                timings.append((timer(lambda c=candidate: run(c)), candidate))
            except OutOfResources as exc:  # too much shared memory / registers on this GPU: not a candidate here
                log.info("fused MoE config %s does not fit this GPU: %s", candidate, exc)
        if not timings:
            raise RuntimeError(f"no fused MoE launch config fits this GPU for {shape.key()}")
        best_ms, best = min(timings, key=lambda t: t[0])
        log.info("fused MoE %s: %s (%.3f ms)", shape.key(), best, best_ms)
        table[shape.key()] = asdict(best)
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: a concurrent reader sees the old table or the new one
        return best
