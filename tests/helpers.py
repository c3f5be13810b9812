"""Test helpers that reach below the public API."""

from __future__ import annotations

import torch

from tokenmill.engine.input_batch import InputBatch
from tokenmill.kvcache.cache import KVCache
from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler.output import NewRequestData, RunningRequestData


@torch.inference_mode()
def teacher_forced_logits(model: torch.nn.Module, kv_cache: KVCache, token_ids: list[int],
                          chunk: int | None = None) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of a request fed through the runner's persistent batch and the paged cache
    ``chunk`` tokens per step (None: the whole prompt in one step; 1: every position is a decode reading the cache)."""
    block_size, groups = kv_cache.spec.block_size, kv_cache.spec.groups.num_groups
    num_blocks = -(-len(token_ids) // block_size)
    assert num_blocks * groups <= kv_cache.num_blocks
    # Blocks from the pool's far end, so block ids are not simply 0, 1, 2...; each KV group its own (all kept).
    tables = [[kv_cache.num_blocks - 1 - g * num_blocks - b for b in range(num_blocks)] for g in range(groups)]
    batch = InputBatch(1, len(token_ids) + 1, block_size, kv_cache.null_block, model.config.vocab_size, (), "cpu",
                       groups)
    batch.add(NewRequestData("probe", list(token_ids), len(token_ids), SamplingParams(), tables, 0))
    chunk = chunk or len(token_ids)
    logits, done = [], 0
    while done < len(token_ids):
        n = min(chunk, len(token_ids) - done)
        inputs = batch.prepare({"probe": n})
        logits.append(model.compute_logits(model(inputs.input_ids, inputs.positions, inputs.attention, kv_cache)))
        done += n
        batch.update(RunningRequestData("probe", [[]] * groups, done, num_blocks, [0] * groups))
    return torch.cat(logits)


def fp8_kv_kl(model: torch.nn.Module, token_ids: list[int], block_size: int, num_blocks: int,
              chunk: int = 1) -> torch.Tensor:
    """Per-position KL(p_fp32_cache || p_fp8_cache) of teacher-forced next-token distributions, fed ``chunk`` tokens
    per step, so each position reads all but at most ``chunk - 1`` of its context back from the cache (1: all of it,
    the worst case for a quantized cache)."""
    logp = {}
    for dtype in ("fp32", "fp8"):
        cache = KVCache(model.kv_cache_spec(dtype, block_size), num_blocks=num_blocks, device="cpu")
        logp[dtype] = teacher_forced_logits(model, cache, token_ids, chunk=chunk).log_softmax(-1)
    return kl_per_position(logp["fp32"], logp["fp8"])


def prefill_logits(model: torch.nn.Module, kv_cache: KVCache, token_ids: list[int]) -> torch.Tensor:
    return teacher_forced_logits(model, kv_cache, token_ids)


def kl_per_position(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p_ref || p) of next-token distributions given as log-probabilities [N, vocab]."""
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)


def next_token_quality(reference: list[torch.Tensor], ours: list[torch.Tensor]) -> tuple[float, float]:
    """(mean KL(p_ref || p) over every position, fraction of positions whose most likely next token agrees) of
    teacher-forced log-probabilities, one [positions, vocab] tensor per prompt."""
    kl = torch.cat([kl_per_position(r, o) for r, o in zip(reference, ours)])
    agree = torch.cat([r.argmax(-1) == o.argmax(-1) for r, o in zip(reference, ours)]).float()
    return kl.mean().item(), agree.mean().item()
