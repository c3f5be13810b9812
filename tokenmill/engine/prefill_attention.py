"""Which kernel runs a CPU prefill chunk's attention over its own tokens (kernels/cpu_attention.py,
own_tokens_attention): PyTorch's flash SDPA, or the AMX tile kernel of kernels/cpu/prefill_attention.c where the
build and the host have AMX and the model computes in bf16. Settled at start-up by timing both at the model's head
layout over a busy step's chunk and a long prompt's; SDPA (what always ran before) stays unless the AMX kernel is
clearly faster, or when the machine is too noisy to tell.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.config import ConfigError
from tokenmill.engine.probe import Clock, Comparison, compare
from tokenmill.kernels.cpu_attention import amx_prefill_attention, own_tokens_attention, prefill_kernel, \
    set_prefill_kernel

log = logging.getLogger(__name__)

# The AMX kernel is kept only when it is at least this much faster (time(SDPA) / time(AMX)).
AMX_MIN_SPEEDUP = 1.05
PROBE_BUDGET_S = 1.5
# The probe's chunks: a 256-token prompt (a busy step's) and a 1,024-token one.
PROBE_LENGTHS = (256, 1024)


def choose_prefill_attention(mode: str, device: str, backend: str, num_heads: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype, threads: int, clock: Clock = time.perf_counter) -> str:
    """"sdpa" | "amx": ``mode`` itself unless "auto" (ConfigError for "amx" where it cannot run); "sdpa" where the
    C kernels do not run (a GPU, the PyTorch references, MLA models: ``num_kv_heads`` 0) or the AMX kernel does
    not apply."""
    runs = device == "cpu" and backend == "cpu" and num_kv_heads > 0 and \
        amx_applies(num_heads, num_kv_heads, head_dim, dtype)
    if mode == "amx" and not runs:
        raise ConfigError("--prefill-attention amx needs a CPU with AMX, the C kernels (kernel_backend cpu), a bf16 "
                          "model with a head size that is a multiple of 32, and no MLA")
    if mode != "auto":
        return mode
    if not runs:
        return "sdpa"
    comparison = time_amx_over_sdpa(num_heads, num_kv_heads, head_dim, threads, clock=clock)
    if comparison.ratio is None:
        log.warning("prefill attention: SDPA, since the machine is too noisy to tell (%s)", comparison.describe())
        return "sdpa"
    chosen = "amx" if comparison.ratio * AMX_MIN_SPEEDUP <= 1.0 else "sdpa"
    log.info("prefill attention: %s (the AMX kernel's time / SDPA's: %s)", chosen.upper(), comparison.describe())
    return chosen


def amx_applies(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the AMX kernel runs this model's chunks here (it answers None where it does not)."""
    if dtype is not torch.bfloat16 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        return False
    q, kv = torch.zeros(2, num_heads, head_dim, dtype=dtype), torch.zeros(2, num_kv_heads, head_dim, dtype=dtype)
    return amx_prefill_attention(q, kv, kv, 1.0) is not None


def time_amx_over_sdpa(num_heads: int, num_kv_heads: int, head_dim: int, threads: int,
                       clock: Clock = time.perf_counter, budget_s: float = PROBE_BUDGET_S) -> Comparison:
    """time(AMX) / time(SDPA) of one chunk's attention per PROBE_LENGTHS on ``threads`` threads, leaving the kernel
    choice and torch's thread count as it found them."""
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(length, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
              for length in PROBE_LENGTHS]

    def case(kernel: str, qkv: torch.Tensor):
        q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)

        def run() -> None:
            set_prefill_kernel(kernel)
            own_tokens_attention(q, k, v, head_dim ** -0.5)
        return run

    before, before_threads = prefill_kernel(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = [(case("sdpa", qkv), case("amx", qkv)) for qkv in chunks]
        for sdpa, amx in cases:
            sdpa(), amx()  # warm-up
        return compare(cases, clock=clock, budget_s=budget_s)
    finally:
        set_prefill_kernel(before)
        torch.set_num_threads(before_threads)
