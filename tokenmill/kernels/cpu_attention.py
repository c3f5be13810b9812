"""Paged attention on a CPU without a gather: the C kernel of kernels/cpu/paged_attention.c walks each request's
block table in place (per request, per KV head, online softmax over blocks), for every cache dtype (fp32, bf16,
fp16, fp8 with its scales). A bf16 model's queries over a bf16 cache take the kernel's bf16 path where the build has
AVX512-BF16 (K and V read as bf16, products summed in float32, probabilities rounded to bf16 for P V), and so do its
queries over an fp8 cache where the build has AVX512-VBMI too (the codes turned into bf16 by byte lookups, exactly, the
scales applied to scores and probabilities); everything else is widened to float32 a block at a time.

Same contract as kernels/paged_attention.py's reference (shapes, null block, what each query sees):
- a decode (one query) attends its whole sequence from the cache in one kernel segment;
- a prefill chunk attends its cached prefix and its own tokens, by one of three kernels (``set_prefill_kernel``,
  whichever start-up timed fastest: engine/prefill_attention.py):
  - "paged": the C kernel over the cache alone, in one causal segment per chunk (the attention op wrote the
    chunk's K/V there first), with the step's decodes in the same call: no own-token pass and no merge. A bf16
    model over a bf16 cache only (an fp8 cache would quantize the chunk's own keys, which the others read exact);
  - "amx" / "avx512" over a bf16 cache: kernels/cpu/prefill_attention.c (on AMX tiles, or in zmm registers with
    AVX512-BF16), each chunk's cached prefix read from the cache through its block table and its own tokens from
    ``k_new``/``v_new``, causally, in one softmax (``prefill_with_prefixes``; the step's decodes by the cache kernel);
  - "sdpa", or "amx" / "avx512" over another cache: the prefix from the cache (a segment of all its queries, no mask
    needed: every query sees the whole prefix) and the own tokens, unquantized from ``k_new``/``v_new``, causally,
    through PyTorch's flash SDPA or kernels/cpu/prefill_attention.c; the two partial softmaxes merged by their
    log-sum-exps.

Attention features (kernels/attention_features.py): a decode's window is where its segment starts in the cache,
soft-capping is applied to every score in the kernel, and sinks scale the finished rows by ``sigmoid(lse - sink)``.
A prefill chunk of a layer with any feature runs the reference's path (its queries' windows start at different
places, and flash SDPA caps nothing); decode is what runs every step.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from tokenmill.kernels.attention_features import PLAIN, AttentionFeatures, apply_sinks
from tokenmill.kernels.cpu_native import library
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.paged_attention import prefill_chunk_attention

KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}


def cache_attention(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                    segments: torch.Tensor, sm_scale: float, softcap: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D] over the cache -> (out [N, Hq, D] float32, lse [N, Hq] float32) for the rows the segments
    cover (others undefined). ``segments`` [5, S] int32: block-table row, first query row, query count, first
    cache token seen, cache tokens (end)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built (kernels/cpu_native.py logged why)")
    q32 = q.float().contiguous()
    num_tokens, hq, dim = q32.shape
    hkv = data.shape[2] // 2
    out = torch.empty_like(q32)
    lse = torch.empty(num_tokens, hq, dtype=torch.float32)
    tables = block_tables if block_tables.dtype == torch.int64 else block_tables.long()
    tables = tables.contiguous()
    segments = segments.contiguous()
    code = lib.tm_paged_attention(
        q32.data_ptr(), out.data_ptr(), lse.data_ptr(), data.data_ptr(),
        scales.data_ptr() if scales is not None else None, KINDS[data.dtype], tables.data_ptr(), tables.stride(0),
        segments[0].data_ptr(), segments[1].data_ptr(), segments[2].data_ptr(), segments[3].data_ptr(),
        segments[4].data_ptr(), segments.shape[1], hq, hkv, dim, data.shape[1], sm_scale, softcap,
        int(q.dtype == torch.bfloat16), torch.get_num_threads())
    if code != 0:
        raise MemoryError("CPU paged attention: scratch allocation failed")
    return out, lse


def step_arguments(tables: torch.Tensor, segments: torch.Tensor) -> tuple[int, ...]:
    """The kernel's per-step arguments (block tables, the segments' six rows, their count), built once a step:
    each tensor index or data_ptr() here costs microseconds, thirty layers a step."""
    return (tables.data_ptr(), tables.stride(0), *(segments[i].data_ptr() for i in range(6)), segments.shape[1])


def step_attention_bf16(q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None,
                        arguments: tuple[int, ...], sm_scale: float, softcap: float = 0.0) -> torch.Tensor:
    """A step's segments (decodes, and prefill chunks as causal segments): bf16 q [N, Hq, D] (heads contiguous within
    a token) -> bf16 out [N, Hq, D], the kernel widening and rounding itself, rows no segment covers zero (a bf16
    model's every decode step; its prefill steps under the "paged" prefill kernel, or the decodes beside chunks under
    an own-token one)."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    num_tokens, hq, dim = q.shape
    out = torch.empty((num_tokens, hq, dim), dtype=torch.bfloat16)
    code = library().tm_paged_attention_bf16(
        q.data_ptr(), q.stride(0), out.data_ptr(), num_tokens, data.data_ptr(),
        scales.data_ptr() if scales is not None else None, KINDS[data.dtype], *arguments, hq,
        data.shape[2] // 2, dim, data.shape[1], sm_scale, softcap, torch.get_num_threads())
    if code != 0:
        raise MemoryError("CPU paged attention: scratch allocation failed")
    return out


def write_kv_cpu(data: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """k/v [T, Hkv, D] into the cache at ``slot_mapping`` [T] (int64; negative: nothing) by the C kernel, as
    kernels/kv_write.py's reference does, in one call and with no concatenated copy. False (nothing written) where
    it does not apply: no kernels, a cache of another dtype (fp8, or a cast), heads not contiguous in a token's row."""
    lib = library()
    if lib is None or k.dtype != data.dtype or v.dtype != data.dtype or slot_mapping.dtype != torch.int64 \
            or k.stride(2) != 1 or v.stride(2) != 1 or k.stride(1) != k.shape[2] or v.stride(1) != v.shape[2]:
        return False
    num_slots = data.shape[0] * data.shape[1]
    if lib.tm_write_kv(data.data_ptr(), num_slots, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                       slot_mapping.data_ptr(), slot_mapping.shape[0], k.shape[1], k.shape[2], k.element_size()):
        raise IndexError(f"a KV slot past the cache's {num_slots}")
    return True


PREFETCH_TARGETS = ("l1", "l2")


def set_prefetch_target(target: str) -> None:
    """Where the kernel asks for the next cache block's lines: "l1" (prefetcht0) or "l2" (prefetcht2), for the whole
    process (settled once at start-up: engine/attention_prefetch.py)."""
    if target not in PREFETCH_TARGETS:
        raise ValueError(f"attention prefetch target {target!r}: expected one of {PREFETCH_TARGETS}")
    lib = library()
    if lib is not None:
        lib.tm_set_attention_prefetch(int(target == "l2"))


def prefetch_target() -> str:
    lib = library()
    return "l2" if lib is not None and lib.tm_attention_prefetch() else "l1"


def _segments(meta: AttentionMetadata, window: int, with_prefills: bool, causal: bool = False) -> torch.Tensor:
    """[6, S] int32 (built once per step and window): block-table row, first query row, query count, first cache
    token seen, cache tokens (end), causal flag. Every decode (from its window's start), and, when
    ``with_prefills``, every prefill chunk: with ``causal``, over its whole sequence as a causal segment (its own
    tokens are in the cache); else over its cached prefix, where it has one."""
    rows, decodes = [], set(meta.decode_indices)
    for i in range(len(meta.seq_lens)):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if i in decodes:
            rows.append((i, start, 1, max(0, meta.seq_lens[i] - window) if window else 0, meta.seq_lens[i], 0))
        elif with_prefills and causal:
            rows.append((i, start, end - start, 0, meta.seq_lens[i], 1))
        elif with_prefills and meta.seq_lens[i] > end - start:
            rows.append((i, start, end - start, 0, meta.seq_lens[i] - (end - start), 0))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 6).t().contiguous()


# The kernel of a prefill chunk's attention, per process: "sdpa" (PyTorch's CPU flash SDPA over its own tokens, through
# own_tokens_attention), "amx" / "avx512" (kernels/cpu/prefill_attention.c, bf16 on AMX tiles / in zmm registers by
# vdpbf16ps) or "paged" (the paged kernel's causal segments, the prefix with them: see the top of this file); settled
# once at start-up by timing them (engine/prefill_attention.py).
PREFILL_KERNELS = ("sdpa", "amx", "avx512", "paged")
# The own-token kernels of kernels/cpu/prefill_attention.c: PREFILL_KERNELS name -> its C function.
C_PREFILL_KERNELS = {"amx": "tm_prefill_attention_amx", "avx512": "tm_prefill_attention_avx512"}
_prefill_kernel = "sdpa"


def set_prefill_kernel(kernel: str) -> None:
    global _prefill_kernel
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill attention kernel {kernel!r}: one of {PREFILL_KERNELS}")
    _prefill_kernel = kernel


def prefill_kernel() -> str:
    return _prefill_kernel


class PrefillPrefix(ctypes.Structure):
    """kernels/cpu/prefill_attention.c's tm_prefill_prefix: the chunks' cached prefixes in a bf16 paged cache, chunk
    c's the first prefix_lens[c] tokens (0: none) of block-table row table_rows[c]."""
    _fields_ = [("cache", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("table_rows", ctypes.c_void_p), ("prefix_lens", ctypes.c_void_p)]


def chunk_runs(meta: AttentionMetadata) -> list[tuple[int, int]]:
    """(first row, rows) of each prefill chunk, in ``meta.prefill_indices`` order (built once a step)."""
    starts = meta.query_start_loc
    return meta.derived("cpu_chunk_runs", lambda: [(starts[i], starts[i + 1] - starts[i])
                                                   for i in meta.prefill_indices])


def chunk_prefixes(meta: AttentionMetadata) -> torch.Tensor | None:
    """[2, chunks] int64 (built once a step): each prefill chunk's block-table row and cached prefix length, in
    ``meta.prefill_indices`` order; None where no chunk has a cached prefix."""
    def build():
        starts = meta.query_start_loc
        lens = [meta.seq_lens[i] - (starts[i + 1] - starts[i]) for i in meta.prefill_indices]
        return torch.tensor([list(meta.prefill_indices), lens], dtype=torch.int64) if any(lens) else None
    return meta.derived("cpu_chunk_prefixes", build)


def c_prefill_attention(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                        chunks: Sequence[tuple[int, int]] | None = None, out: torch.Tensor | None = None,
                        prefix: PrefillPrefix | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """own_tokens_attention by ``kernel`` (a C_PREFILL_KERNELS name) for each chunk (start row, length; default: all
    rows, one chunk) of bf16 q [T, Hq, D], k/v [T, Hkv, D] (heads contiguous within a token), in one call -> (out [T,
    Hq, D] bf16: ``out`` where given, contiguous; lse [T, Hq] float32), the chunks' rows written, others untouched; or
    None where the kernel does not apply (not in this build or host: AMX, AVX512-BF16; another dtype or layout; D not
    a multiple of 32). With ``prefix``, each chunk attends its cached prefix (read from the cache) before its own
    tokens, in one softmax."""
    lib = library()
    if lib is None or not all(t.dtype is torch.bfloat16 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
                              for t in (q, k, v)):
        return None
    num_tokens, hq, dim = q.shape
    if out is None:
        out = torch.empty((num_tokens, hq, dim), dtype=torch.bfloat16)
    elif out.dtype is not torch.bfloat16 or not out.is_contiguous():
        return None
    lse = torch.empty((num_tokens, hq), dtype=torch.float32)
    runs = torch.tensor(chunks if chunks is not None else [(0, num_tokens)], dtype=torch.int64).reshape(-1, 2)
    runs = runs.t().contiguous()  # [2, chunks]: starts, lengths
    code = getattr(lib, C_PREFILL_KERNELS[kernel])(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
        lse.data_ptr(), runs[0].data_ptr(), runs[1].data_ptr(), runs.shape[1], hq, k.shape[1], dim, sm_scale,
        ctypes.byref(prefix) if prefix is not None else None, torch.get_num_threads())
    if code == -2:
        raise MemoryError("CPU prefill attention: scratch allocation failed")
    return (out, lse) if code == 0 else None


def own_tokens_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's causal attention over its own tokens: q [L, Hq, D], k/v [L, Hkv, D] -> (out [L, Hq, D] in q's
    dtype, lse [L, Hq] float32)."""
    if _prefill_kernel in C_PREFILL_KERNELS:
        result = c_prefill_attention(_prefill_kernel, q, k, v, sm_scale)
        if result is not None:
            return result
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype), 0.0,
        True, scale=sm_scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two partial softmax attentions over disjoint keys ([L, H, D] with their [L, H] log-sum-exps) -> one, in
    float32."""
    out_a, out_b = out_a.float(), out_b.float()
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None]


def paged_prefill_applies(q_dtype: torch.dtype, cache_dtype: torch.dtype | None) -> bool:
    """Whether the "paged" prefill kernel serves chunks of this model and cache: bf16 queries over a bf16 cache (one
    that carries no scales: only fp8 caches do). Start-up (engine/prefill_attention.py) and every step ask this."""
    return q_dtype is torch.bfloat16 and cache_dtype is torch.bfloat16


def prefill_with_prefixes(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                          meta: AttentionMetadata, sm_scale: float) -> torch.Tensor | None:
    """A step with prefill chunks under an own-token C kernel, over a bf16 cache: its decodes by the cache kernel's
    bf16 path, its chunks by the own-token kernel, each over its cached prefix (read from the cache) and its own tokens
    in one softmax -> out [T, Hq, D] bf16; or None where the kernel does not take these tensors."""
    segments = meta.derived(("cpu_segments", 0, False, False), lambda: _segments(meta, 0, with_prefills=False))
    tables = meta.derived("cpu_block_tables", lambda: meta.block_tables.long().contiguous())
    if segments.shape[1]:  # the decodes' rows (the chunks' rows zero, overwritten below)
        arguments = meta.derived(("cpu_step_arguments", 0, False, False), lambda: step_arguments(tables, segments))
        out = step_attention_bf16(q, data, None, arguments, sm_scale)
    else:
        out = torch.empty(q.shape, dtype=torch.bfloat16)
    chunks, prefixes = chunk_runs(meta), chunk_prefixes(meta)
    prefix = PrefillPrefix(data.data_ptr(), tables.data_ptr(), tables.stride(0), data.shape[1], prefixes[0].data_ptr(),
                           prefixes[1].data_ptr()) if prefixes is not None else None
    done = c_prefill_attention(_prefill_kernel, q, k_new, v_new, sm_scale, chunks, out, prefix)
    return out if done is not None else None


def paged_attention_cpu(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, data: torch.Tensor,
                        scales: torch.Tensor | None, meta: AttentionMetadata, sm_scale: float,
                        features: AttentionFeatures = PLAIN) -> torch.Tensor:
    plain = features.plain
    if plain and meta.prefill_indices and _prefill_kernel in C_PREFILL_KERNELS and q.dtype is torch.bfloat16 \
            and paged_prefill_applies(q.dtype, data.dtype):
        out = prefill_with_prefixes(q, k_new, v_new, data, meta, sm_scale)
        if out is not None:
            return out
    causal = bool(meta.prefill_indices) and plain and _prefill_kernel == "paged" and \
        paged_prefill_applies(q.dtype, data.dtype)
    segments = meta.derived(("cpu_segments", features.window, plain, causal),
                            lambda: _segments(meta, features.window, with_prefills=plain, causal=causal))
    tables = meta.derived("cpu_block_tables", lambda: meta.block_tables.long().contiguous())
    if (causal or not meta.prefill_indices) and features.sinks is None and q.dtype is torch.bfloat16 \
            and segments.shape[1]:
        arguments = meta.derived(("cpu_step_arguments", features.window, plain, causal),
                                 lambda: step_arguments(tables, segments))
        return step_attention_bf16(q, data, scales, arguments, sm_scale, features.softcap)
    from_cache, lse = cache_attention(q, data, scales, tables, segments, sm_scale, features.softcap) \
        if segments.shape[1] else (None, None)
    if from_cache is not None and features.sinks is not None:  # only decodes are in the segments
        from_cache = apply_sinks(from_cache, lse, features.sinks)
    if not meta.prefill_indices:
        return from_cache.to(q.dtype)
    out = torch.empty_like(q) if from_cache is None else from_cache.to(q.dtype)
    if not plain:
        for i in meta.prefill_indices:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = prefill_chunk_attention(i, q, k_new, v_new, data, scales, meta, sm_scale, features)
        return out
    if _prefill_kernel in C_PREFILL_KERNELS:  # every chunk's own tokens in one call, straight into out
        chunks = [(meta.query_start_loc[i], meta.query_start_loc[i + 1] - meta.query_start_loc[i])
                  for i in meta.prefill_indices]
        done = c_prefill_attention(_prefill_kernel, q, k_new, v_new, sm_scale, chunks, out)
        if done is not None:
            for i, (start, length) in zip(meta.prefill_indices, chunks):
                if meta.seq_lens[i] > length:  # a cached prefix: merge its part in
                    end = start + length
                    out[start:end] = merge(from_cache[start:end], lse[start:end], out[start:end],
                                           done[1][start:end]).to(q.dtype)
            return out
    for i in meta.prefill_indices:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        own, own_lse = own_tokens_attention(q[start:end], k_new[start:end], v_new[start:end], sm_scale)
        if meta.seq_lens[i] > end - start:  # a cached prefix: merge its part in
            own = merge(from_cache[start:end], lse[start:end], own, own_lse)
        out[start:end] = own.to(q.dtype)
    return out
