"""Block tables per request, on top of the BlockPool. Pure Python.

A request's ``block_ids`` always cover at least its ``num_computed_tokens``; ``allocate_slots`` extends them to
cover the tokens a step is about to compute.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.kvcache.block_pool import BlockPool


class HasBlocks(Protocol):
    block_ids: list[int]
    num_computed_tokens: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_needed(self, request: HasBlocks, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def allocate_slots(self, request: HasBlocks, num_new_tokens: int) -> bool:
        """Grow the request's block table for ``num_new_tokens`` more tokens; False if the pool is short."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def free(self, request: HasBlocks) -> None:
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
