"""Where the CPU attention kernel asks for the next cache block's lines (kernels/cpu/paged_attention.c,
prefetch_slice): into the L1 (prefetcht0) or only as far as the L2 (prefetcht2). Settled at start-up by timing
the kernel both ways at the model's head layout on caches twice the size of the last-level cache, as a decode
step meets its layers' caches: from memory.

A core tracks only so many outstanding L1 misses. On a 2-core Zen 4 EPYC a block asked into the L1 held them while
the compute's own loads waited, and the L2 target made decode attention 1.15-1.64x faster (BENCHMARKS.md); other
hosts are measured, not assumed. The L1 target (what the kernel always did before) stays unless the L2 one is
clearly faster, or when the machine is too noisy to tell.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from tokenmill.engine.probe import Clock, Comparison, compare
from tokenmill.kernels.cpu_attention import cache_attention, prefetch_target, set_prefetch_target

log = logging.getLogger(__name__)

# The L2 target is kept only when it is at least this much faster (time(L1) / time(L2)).
L2_MIN_SPEEDUP = 1.05
PROBE_BUDGET_S = 1.5
# The probe's decodes: a busy step's requests, each over this many cached tokens.
PROBE_REQUESTS, PROBE_CONTEXT = 16, 256
# The probe's caches stop at this many bytes whatever the last-level cache (some hosts have a GiB of L3).
PROBE_MAX_BYTES = 256 * 2**20
CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def last_level_cache_bytes() -> int:
    """The largest CPU cache the kernel sees (sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for entry in CPU_CACHE_DIR.glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes, default=32 * 2**20)


def choose_attention_prefetch(mode: str, device: str, backend: str, num_heads: int, num_kv_heads: int,
                              head_dim: int, block_size: int, kv_dtype: str, dtype: torch.dtype, threads: int,
                              clock: Clock = time.perf_counter) -> str:
    """"l1" | "l2": ``mode`` itself unless "auto"; "l1" where the C attention kernel does not run (a GPU, the
    PyTorch references, MLA models: ``num_kv_heads`` 0)."""
    if mode != "auto":
        return mode
    if device != "cpu" or backend != "cpu" or not num_kv_heads:
        return "l1"
    comparison = time_l2_over_l1(num_heads, num_kv_heads, head_dim, block_size, CACHE_DTYPES[kv_dtype], dtype,
                                 threads, clock=clock)
    if comparison.ratio is None:
        log.warning("attention prefetch: L1, since the machine is too noisy to tell (%s)", comparison.describe())
        return "l1"
    chosen = "l2" if comparison.ratio * L2_MIN_SPEEDUP <= 1.0 else "l1"
    log.info("attention prefetch: %s (decode attention with the L2 target / the L1 one: %s)", chosen.upper(),
             comparison.describe())
    return chosen


def time_l2_over_l1(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype,
                    dtype: torch.dtype, threads: int, clock: Clock = time.perf_counter,
                    budget_s: float = PROBE_BUDGET_S, cache_bytes: int | None = None) -> Comparison:
    """time(L2 target) / time(L1 target) of PROBE_REQUESTS decodes on ``threads`` threads over cold caches
    (``cache_bytes`` of them in all, default twice the last-level cache up to PROBE_MAX_BYTES), leaving the
    kernel's target and torch's thread count as it found them."""
    blocks = PROBE_REQUESTS * -(-PROBE_CONTEXT // block_size)
    layer_bytes = (blocks + 1) * block_size * 2 * num_kv_heads * head_dim * kv_dtype.itemsize
    total = cache_bytes or min(2 * last_level_cache_bytes(), PROBE_MAX_BYTES)
    layers = max(1, math.ceil(total / layer_bytes))
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(blocks + 1, block_size, 2 * num_kv_heads, head_dim, generator=gen).to(kv_dtype)
              for _ in range(layers)]
    scales = [torch.ones(blocks + 1, block_size, 2 * num_kv_heads) if kv_dtype.itemsize == 1 else None
              for _ in range(layers)]
    tables = torch.randperm(blocks, generator=gen).view(PROBE_REQUESTS, -1)
    rows = torch.arange(PROBE_REQUESTS, dtype=torch.int32)
    # one decode segment per request: its table row, query row, one query, its whole context
    segments = torch.stack([rows, rows, torch.ones_like(rows), torch.zeros_like(rows),
                            torch.full_like(rows, PROBE_CONTEXT)])
    q = torch.randn(PROBE_REQUESTS, num_heads, head_dim, generator=gen).to(dtype)

    def sweep(target: str):
        def run() -> None:
            set_prefetch_target(target)
            for data, scale in zip(caches, scales):
                cache_attention(q, data, scale, tables, segments, head_dim ** -0.5)
        return run

    before, before_threads = prefetch_target(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        l1, l2 = sweep("l1"), sweep("l2")
        l1(), l2()  # warm-up: the kernel built and loaded, the pages touched
        return compare([(l1, l2)], clock=clock, budget_s=budget_s)
    finally:
        set_prefetch_target(before)
        torch.set_num_threads(before_threads)

