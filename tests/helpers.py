"""Test helpers that reach below the public API."""

from __future__ import annotations

import torch

from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.models.runner import ModelRunner
from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler.request import Request
from tokenmill.scheduler.scheduler import ScheduledChunk, SchedulerOutput


@torch.inference_mode()
def teacher_forced_logits(model: torch.nn.Module, kv_cache: KVCache, token_ids: list[int],
                          chunk: int | None = None) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of a request fed through the runner and the paged cache ``chunk`` tokens
    per step (None: the whole prompt in one step; 1: every position is a decode reading the cache)."""
    kv = KVCacheManager(kv_cache.num_blocks, kv_cache.spec.block_size)
    request = Request("probe", list(token_ids), SamplingParams(max_tokens=1), max_tokens=1)
    assert kv.allocate_slots(request, len(token_ids))
    # Scatter the request over the pool's far end so block ids are not simply 0, 1, 2...
    request.block_ids = [kv_cache.num_blocks - 1 - b for b in request.block_ids]
    runner = ModelRunner(model, kv_cache, "cpu")
    chunk = chunk or len(token_ids)
    logits = []
    while request.num_computed_tokens < len(token_ids):
        step = ScheduledChunk.next_for(request, min(chunk, len(token_ids) - request.num_computed_tokens))
        ids, positions, meta, _ = runner.prepare(SchedulerOutput([step]))
        logits.append(model.compute_logits(model(ids, positions, meta, kv_cache)))
        request.num_computed_tokens += step.num_tokens
    return torch.cat(logits)


def fp8_kv_kl(model: torch.nn.Module, token_ids: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Per-position KL(p_fp32_cache || p_fp8_cache) of teacher-forced next-token distributions, every position
    decoded from the cache (the worst case for a quantized cache)."""
    logp = {}
    for dtype in ("fp32", "fp8"):
        cache = KVCache(model.kv_cache_spec(dtype, block_size), num_blocks=num_blocks, device="cpu")
        logp[dtype] = teacher_forced_logits(model, cache, token_ids, chunk=1).log_softmax(-1)
    return kl_per_position(logp["fp32"], logp["fp8"])


def prefill_logits(model: torch.nn.Module, kv_cache: KVCache, token_ids: list[int]) -> torch.Tensor:
    return teacher_forced_logits(model, kv_cache, token_ids)


def kl_per_position(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p_ref || p) of next-token distributions given as log-probabilities [N, vocab]."""
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)
