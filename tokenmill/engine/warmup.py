"""Start-up work on a CPU before the first request: pick the thread layout by measurement, compile, warm up.

Both run synthetic steps through the real model and KV cache (``synthetic_step``). The pool hands out no block before
the first request, and a request reads only slots it has written, so what these steps write is never read.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import KVCache
from tokenmill.models.compile import WARM_UP_TOKENS, CompiledDecoder, use_cache_dir

log = logging.getLogger(__name__)

# Decode batches the thread layout is timed on: a lone request and a busy step.
THREAD_PROBE_BATCHES = (1, 16)
# Leave a core to the API process only where the engine loses nothing by it (geometric mean over the probe batches).
# A 1.25 threshold was tried and measured: on a 2-core EPYC it kept 1 thread (ratios 0.94 at batch 1, 1.25 at 16),
# which gained 1.41x output tokens/s at concurrency 1 but lost 0.71x at 16 (benchmarks/results/compare-cpu-compiled).
ALL_CORES_MIN_SPEEDUP = 1.0


def synthetic_step(kv_cache: KVCache, num_requests: int, tokens_per_request: int, context_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Inputs of a step where each of ``num_requests`` requests computes its last ``tokens_per_request`` of
    ``context_len`` tokens, over consecutive blocks of the cache (clamped to what the cache holds)."""
    block_size = kv_cache.spec.block_size
    blocks_per_request = -(-context_len // block_size)
    num_requests = max(1, min(num_requests, kv_cache.num_blocks // blocks_per_request))
    device = kv_cache.data[0].device
    tables = torch.arange(num_requests * blocks_per_request, device=device).view(num_requests, blocks_per_request)
    positions = torch.arange(context_len - tokens_per_request, context_len, device=device).repeat(num_requests)
    rows = torch.arange(num_requests, device=device).repeat_interleave(tokens_per_request)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    kinds = list(range(num_requests))
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=[i * tokens_per_request for i in range(num_requests + 1)],
        seq_lens=[context_len] * num_requests, block_tables=tables, block_size=block_size,
        decode_indices=kinds if tokens_per_request == 1 else [],
        prefill_indices=[] if tokens_per_request == 1 else kinds)
    input_ids = torch.zeros(num_requests * tokens_per_request, dtype=torch.int64, device=device)
    return input_ids, positions, meta


@torch.inference_mode()
def _decode_seconds(model: torch.nn.Module, kv_cache: KVCache, batch: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` time of one decode step of ``batch`` requests over 256-token contexts."""
    input_ids, positions, meta = synthetic_step(kv_cache, batch, 1, 256)
    model(input_ids, positions, meta, kv_cache)  # warm-up: first calls size buffers, fault pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids, positions, meta, kv_cache)
        times.append(time.perf_counter() - start)
    return min(times)


def choose_num_threads(model: torch.nn.Module, kv_cache: KVCache, cores: int) -> int:
    """``cores`` threads, or ``cores - 1`` (one core left to the API process) unless all of them decode more than
    ``ALL_CORES_MIN_SPEEDUP`` x faster; the two layouts are timed alternately, on the model itself."""
    if cores < 2:
        return max(cores, 1)
    best: dict[int, list[float]] = {cores: [math.inf] * len(THREAD_PROBE_BATCHES),
                                    cores - 1: [math.inf] * len(THREAD_PROBE_BATCHES)}
    for _ in range(2):
        for threads in best:
            torch.set_num_threads(threads)
            for i, batch in enumerate(THREAD_PROBE_BATCHES):
                best[threads][i] = min(best[threads][i], _decode_seconds(model, kv_cache, batch))
    ratios = [fewer / every for fewer, every in zip(best[cores - 1], best[cores])]
    speedup = math.prod(ratios) ** (1 / len(ratios))
    chosen = cores if speedup > ALL_CORES_MIN_SPEEDUP else cores - 1
    torch.set_num_threads(chosen)
    log.info("engine threads: %d of %d cores (decode step with %d threads / with %d, batches %s: %s)", chosen, cores,
             cores - 1, cores, THREAD_PROBE_BATCHES, ", ".join(f"{r:.2f}" for r in ratios))
    return chosen


@torch.inference_mode()
def warm_up(model: torch.nn.Module, kv_cache: KVCache, token_counts: tuple[int, ...]) -> float:
    """Run one step of each token count (each shape class of the compiled decoder); returns the seconds it took."""
    start = time.perf_counter()
    for tokens in token_counts:
        input_ids, positions, meta = synthetic_step(kv_cache, 1, tokens, max(tokens, 16))
        model(input_ids, positions, meta, kv_cache)
    return time.perf_counter() - start


def prepare_cpu(model: torch.nn.Module, kv_cache: KVCache, config: EngineConfig) -> None:
    """Thread layout (unless ``num_threads`` is set), then compile and warm up (unless ``enforce_eager``)."""
    if config.num_threads is None:
        choose_num_threads(model, kv_cache, available_cores())
    if config.enforce_eager or not model.compilable:
        log.info("model runs eagerly (%s)", "enforce_eager" if config.enforce_eager else
                 f"{type(model).__name__} is not compiled")
        return
    cache_dir = use_cache_dir(config.compile_cache_dir)
    compiled = CompiledDecoder(model)
    model.compiled_decoder = compiled
    seconds = warm_up(model, kv_cache, WARM_UP_TOKENS)
    compiled.sealed = True
    log.info("compiled the layer stack in %.1f s (shape classes: 1 token, 2+ tokens; generated code cached in %s)",
             seconds, cache_dir)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
