"""Which kernel runs a CPU prefill chunk's attention (kernels/cpu_attention.py): PyTorch's flash SDPA over its own
tokens; the kernel of kernels/cpu/prefill_attention.c for a model that computes in bf16, on AMX tiles ("amx": where
the build and the host have AMX) or in zmm registers ("avx512": where the build has AVX512-BF16); or "paged", the
cache kernel of kernels/cpu/paged_attention.c with the chunk as a causal segment of its sequence (a bf16 model over a
bf16 cache). Settled at start-up by timing each candidate against the best so far at the model's head layout over a
busy step's chunk, a long prompt's and a chunk after a cached prefix (a prefix-cache hit: the own-token kernels read
the prefix themselves, "paged" covers it in its causal segment, SDPA's own tokens are merged with the cache kernel's
pass over it); SDPA (what always ran before) stays unless another is clearly faster, or when the machine is too noisy
to tell.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from tokenmill.config import ConfigError
from tokenmill.engine.probe import Clock, Comparison, compare
from tokenmill.kernels.cpu_attention import c_prefill_attention, own_tokens_attention, paged_attention_cpu, \
    paged_prefill_applies, prefill_kernel, set_prefill_kernel, step_arguments, step_attention_bf16
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import STORAGE_DTYPES

log = logging.getLogger(__name__)

# Another kernel replaces the one chosen so far only when it is at least this much faster (time(old) / time(new)).
MIN_SPEEDUP = 1.05
PROBE_BUDGET_S = 1.5
# The probe's chunks: a 256-token prompt (a busy step's) and a 1,024-token one; and (cached tokens, chunk tokens) of a
# chunk after a cached prefix.
PROBE_LENGTHS = (256, 1024)
PROBE_PREFIXED = (768, 256)


def choose_prefill_attention(mode: str, device: str, backend: str, num_heads: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype, threads: int, clock: Clock = time.perf_counter,
                             kv_dtype: str | None = None, block_size: int = 16) -> str:
    """"sdpa" | "amx" | "avx512" | "paged": ``mode`` itself unless "auto" (ConfigError for a kernel that cannot run);
    "sdpa" where the C kernels do not run (a GPU, the PyTorch references, MLA models: ``num_kv_heads`` 0) or no other
    kernel applies. ``kv_dtype`` (the settled KV cache dtype; None: not known, so "paged" is not a candidate) and
    ``block_size`` are the cache's."""
    cpu = device == "cpu" and backend == "cpu" and num_kv_heads > 0
    candidates = {"amx": cpu and c_kernel_applies("amx", num_heads, num_kv_heads, head_dim, dtype),
                  "avx512": cpu and c_kernel_applies("avx512", num_heads, num_kv_heads, head_dim, dtype),
                  "paged": cpu and paged_prefill_applies(dtype, STORAGE_DTYPES.get(kv_dtype))}
    for kernel, needs in (("amx", "a CPU with AMX"), ("avx512", "a CPU with AVX512-BF16")):
        if mode == kernel and not candidates[kernel]:
            raise ConfigError(f"--prefill-attention {kernel} needs {needs}, the C kernels (kernel_backend cpu), a "
                              f"bf16 model with a head size that is a multiple of 32 (at most 256), and no MLA")
    if mode == "paged" and not candidates["paged"]:
        raise ConfigError("--prefill-attention paged needs the C kernels (kernel_backend cpu), a bf16 model over a "
                          "bf16 KV cache, and no MLA")
    if mode != "auto":
        return mode
    chosen = "sdpa"
    for candidate in (name for name, runs in candidates.items() if runs):
        comparison = time_kernels(chosen, candidate, num_heads, num_kv_heads, head_dim, threads, block_size,
                                  clock=clock)
        if comparison.ratio is None:
            log.warning("prefill attention: keeping %s over %s, since the machine is too noisy to tell (%s)",
                        chosen.upper(), candidate.upper(), comparison.describe())
            continue
        log.info("prefill attention: %s's time / %s's: %s", candidate.upper(), chosen.upper(), comparison.describe())
        if comparison.ratio * MIN_SPEEDUP <= 1.0:
            chosen = candidate
    log.info("prefill attention: %s", chosen.upper())
    return chosen


def c_kernel_applies(kernel: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether prefill_attention.c's ``kernel`` build runs this model's chunks here (it answers None where it does
    not)."""
    if dtype is not torch.bfloat16 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        return False
    q, kv = torch.zeros(2, num_heads, head_dim, dtype=dtype), torch.zeros(2, num_kv_heads, head_dim, dtype=dtype)
    return c_prefill_attention(kernel, q, kv, kv, 1.0) is not None


def time_kernels(a: str, b: str, num_heads: int, num_kv_heads: int, head_dim: int, threads: int,
                 block_size: int = 16, clock: Clock = time.perf_counter,
                 budget_s: float = PROBE_BUDGET_S) -> Comparison:
    """time(b) / time(a) of one chunk's attention per PROBE_LENGTHS and after PROBE_PREFIXED's cached tokens, on
    ``threads`` threads, leaving the kernel choice and torch's thread count as they were."""
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(length, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
              for length in PROBE_LENGTHS]
    before, before_threads = prefill_kernel(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = [(_chunk_work(a, qkv, num_heads, num_kv_heads, head_dim, block_size),
                  _chunk_work(b, qkv, num_heads, num_kv_heads, head_dim, block_size)) for qkv in chunks]
        cached, own = PROBE_PREFIXED
        qkv = torch.randn(cached + own, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
        cases.append((_prefixed_work(a, qkv, cached, num_heads, num_kv_heads, head_dim, block_size),
                      _prefixed_work(b, qkv, cached, num_heads, num_kv_heads, head_dim, block_size)))
        for work_a, work_b in cases:
            work_a(), work_b()  # warm-up
        return compare(cases, clock=clock, budget_s=budget_s)
    finally:
        set_prefill_kernel(before)
        torch.set_num_threads(before_threads)


def _chunk_work(kernel: str, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int) -> Callable[[], None]:
    """One prompt's attention (qkv [L, Hq + 2 Hkv, D] bf16) as ``kernel`` serves it: the own-token pass of "sdpa",
    "amx" and "avx512"; for "paged", the cache kernel over a cache holding the prompt's K/V (the attention op writes
    them there whatever the kernel), the prompt one causal segment."""
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    sm_scale = head_dim ** -0.5
    if kernel != "paged":
        def own_tokens() -> None:
            set_prefill_kernel(kernel)
            own_tokens_attention(q, k, v, sm_scale)
        return own_tokens
    length = q.shape[0]
    data, tables = _cache_holding(k, v, block_size)
    segments = torch.tensor([[0], [0], [length], [0], [length], [1]], dtype=torch.int32)
    arguments = step_arguments(tables, segments)  # raw pointers: tables and segments must outlive the closure

    def paged(keep=(tables, segments)) -> None:
        step_attention_bf16(q, data, None, arguments, sm_scale)
    return paged


def _cache_holding(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 paged cache holding one sequence's k / v [L, Hkv, D] on blocks 0, 1, ... (and a null block after them),
    and its block table [1, blocks] int64."""
    length, num_kv_heads, head_dim = k.shape
    blocks = -(-length // block_size)
    data = torch.zeros(blocks + 1, block_size, 2 * num_kv_heads, head_dim, dtype=torch.bfloat16)
    data[:blocks].view(-1, 2 * num_kv_heads, head_dim)[:length] = torch.cat([k, v], dim=1)
    return data, torch.arange(blocks, dtype=torch.int64)[None]


def _prefixed_work(kernel: str, qkv: torch.Tensor, cached: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int) -> Callable[[], None]:
    """The attention of a chunk after ``cached`` tokens already in the cache (qkv [cached + L, Hq + 2 Hkv, D] bf16:
    the whole sequence's; the chunk is its last L rows), as serving runs it under ``kernel``: the attention op over a
    cache holding the prefix and the chunk's K/V (the op writes the chunk's there first, whatever the kernel)."""
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    total, length = qkv.shape[0], qkv.shape[0] - cached
    data, tables = _cache_holding(k, v, block_size)
    meta = AttentionMetadata(slot_mapping=torch.arange(cached, total), query_start_loc=[0, length], seq_lens=[total],
                             block_tables=tables, block_size=block_size, decode_indices=[], prefill_indices=[0])
    q, k, v = q[cached:], k[cached:], v[cached:]
    sm_scale = head_dim ** -0.5

    def chunk() -> None:
        set_prefill_kernel(kernel)
        paged_attention_cpu(q, k, v, data, None, meta, sm_scale)
    return chunk
