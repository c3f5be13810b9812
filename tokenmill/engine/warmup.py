"""Start-up work on a CPU before the first request: compile the layer stack, then warm up every shape class.

The warm-up runs synthetic steps through the real model and KV cache (``synthetic_step``). The pool hands out no
block before the first request, and a request reads only slots it has written, so what these steps write is never
read.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import KVCache
from tokenmill.logs import one_line
from tokenmill.models.compile import WARM_UP_TOKENS, CompiledDecoder, use_cache_dir

log = logging.getLogger(__name__)


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
def warm_up(model: torch.nn.Module, kv_cache: KVCache, token_counts: tuple[int, ...]) -> float:
    """Run one step of each token count (each shape class of the compiled decoder); returns the seconds it took."""
    start = time.perf_counter()
    for tokens in token_counts:
        input_ids, positions, meta = synthetic_step(kv_cache, 1, tokens, max(tokens, 16))
        model(input_ids, positions, meta, kv_cache)
    return time.perf_counter() - start


def compile_and_warm_up(model: torch.nn.Module, kv_cache: KVCache, compile_cache_dir: str) -> None:
    """Compile the layer stack (models/compile.py) and run each shape class once, so that serving never compiles.
    Where the compiler fails, ``model.compiled_decoder`` stays None and the model runs eagerly (logged with the cause)
    once an eager step of each shape class ran, so that only a model that cannot run at all fails the start."""
    cache_dir = use_cache_dir(compile_cache_dir)
    compiled = CompiledDecoder(model)
    model.compiled_decoder = compiled
    try:
        seconds = warm_up(model, kv_cache, WARM_UP_TOKENS)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager model computes the same
        model.compiled_decoder = None
        log.warning("execution: eager, since compiling the layer stack failed (%s: %s); --enforce-eager skips the "
                    "attempt", type(exc).__name__, one_line(str(exc), max_lines=1))
        log.debug("the compiler's failure", exc_info=exc)
        warm_up(model, kv_cache, WARM_UP_TOKENS)  # the eager model must run: a failure here is the model's own
        return
    compiled.sealed = True
    log.info("compiled the layer stack in %.1f s (shape classes: 1 token, 2+ tokens; generated code cached in %s)",
             seconds, cache_dir)
