"""Ref-counted pool of fixed-size KV blocks. Pure Python: never imports torch.

Invariants (``check_integrity`` asserts them):
- every block is either used (ref_cnt > 0, not in the free list) or free (ref_cnt == 0, in the free list);
  so ``num_used + num_free == num_blocks``;
- the free list is ordered least recently freed first: ``allocate`` takes from the front (LRU eviction);
- ``_cached`` maps a full block's prefix hash (kvcache/prefix.py) to the block holding it, and that block keeps the
  hash and its token ids; a free block keeps them (its contents stay reusable: a prefix hit revives it with
  ``acquire``) until ``allocate`` hands it out again, which drops them: cached blocks are evicted only when the pool
  needs them, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens while it is cached: hits are checked against them


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> None; an OrderedDict gives O(1) pop-front, append and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions_total = 0  # cached blocks handed out again (their contents lost)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref_cnt 1), evicting the least recently freed ones first."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = block.token_ids = None
                self.num_evictions_total += 1
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the free list.

        Callers pass a request's blocks tail first, so that a prefix's last blocks are evicted before its first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    # --- prefix-hash map (prefix caching)
    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Record that a used block holds, fully computed, the tokens ``token_ids`` whose chained hash is
        ``block_hash``. First writer wins: when another block already holds that hash, this one stays uncached."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            raise RuntimeError(f"cannot cache free block {block_id}")
        if block_hash in self._cached or block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block_id

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The block cached under ``block_hash`` if it holds exactly ``token_ids``, else None."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

    def acquire(self, block_id: int) -> None:
        """Take one more reference to a (possibly free but still cached) block."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self._free[block_id]
        block.ref_cnt += 1

    def check_integrity(self) -> None:
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + len(self._free) == self.num_blocks, "free + used != total"
        assert all(self.blocks[i].ref_cnt == 0 for i in self._free), "free block with references"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, "hash map out of sync"
        assert sum(b.block_hash is not None for b in self.blocks) == len(self._cached), "stale block hash"
        assert all((b.block_hash is None) == (b.token_ids is None) for b in self.blocks), "hash without tokens"
