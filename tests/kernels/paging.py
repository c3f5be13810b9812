"""A mixed batch over a paged cache laid out to catch paging bugs: block tables point at randomly permuted physical
blocks, every unused pool slot holds NaN (only the null block is zero), and the requests mix decodes,
block-aligned and unaligned prefill chunks, with and without a cached prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheSpec


@dataclass
class PagedBatch:
    data: torch.Tensor
    scales: torch.Tensor | None
    meta: AttentionMetadata
    q: torch.Tensor  # [T, Hq, D]: the new tokens' queries
    new_kv: torch.Tensor  # [T, 2Hkv, D]: the new tokens' K heads then V heads, as computed
    full_k: list[torch.Tensor]  # per request [n, Hkv, D]: every position's K as computed (prefix and new)
    full_v: list[torch.Tensor]


def fill_pool_with_nan(data: torch.Tensor, scales: torch.Tensor | None, num_blocks: int) -> None:
    if data.dtype == torch.float8_e4m3fn:
        data[:num_blocks].view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
    else:
        data[:num_blocks].fill_(float("nan"))
    if scales is not None:
        scales[:num_blocks].fill_(float("nan"))


def block_tables(tables: list[list[int]], null_block: int) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [null_block] * (width - len(t)) for t in tables])


def paged_batch(shapes: list[tuple[int, int]], hq: int, hkv: int, d: int, kv_dtype: str, block_size: int,
                num_blocks: int = 64, q_dtype: torch.dtype = torch.float32, seed: int = 0) -> PagedBatch:
    """``shapes``: (tokens already cached, new tokens) per request. The prefix is written with the reference."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(KVCacheSpec.for_gqa(1, hkv, d, kv_dtype, block_size), num_blocks, "cpu")
    data, scales = cache.layer(0)
    fill_pool_with_nan(data, scales, num_blocks)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, qs, starts, seq_lens, full_k, full_v = [], [], [], [0], [], [], []
    for ctx, new in shapes:
        n = ctx + new
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        k = torch.randn(n, hkv, d, generator=gen).to(q_dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(q_dtype)
        positions = torch.arange(n)
        flat = torch.tensor(blocks)[positions // block_size] * block_size + positions % block_size
        write_kv(data, scales, torch.cat([k, v], dim=1)[:ctx], flat[:ctx])
        slots.append(flat[ctx:])
        qs.append(torch.randn(new, hq, d, generator=gen).to(q_dtype))
        full_k.append(k)
        full_v.append(v)
        starts.append(starts[-1] + new)
        seq_lens.append(n)
    new_kv = torch.cat([torch.cat([k, v], dim=1)[ctx:] for (ctx, _), k, v in zip(shapes, full_k, full_v)])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=starts, seq_lens=seq_lens,
        block_tables=block_tables(tables, cache.null_block), block_size=block_size,
        decode_indices=[i for i, (_, new) in enumerate(shapes) if new == 1],
        prefill_indices=[i for i, (_, new) in enumerate(shapes) if new > 1])
    return PagedBatch(data, scales, meta, torch.cat(qs), new_kv, full_k, full_v)


def picker(gen: torch.Generator):
    """pick(options) -> one of them, drawn with ``gen`` (random-shape tests stay reproducible per seed)."""
    return lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]
