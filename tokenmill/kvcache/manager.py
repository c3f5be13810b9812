"""Block tables per request, on top of the BlockPool, and prefix caching. Pure Python.

A request's ``block_ids`` always cover at least its ``num_computed_tokens``; ``allocate_slots`` extends them to
cover the tokens a step is about to compute.

Prefix caching (on unless ``enable_prefix_caching=False``): once a step has computed a request's block in full, the
block is offered to the pool's hash map under its chained hash (kvcache/prefix.py). A request being admitted
(nothing computed) first looks up its leading full blocks; the hits become its computed prefix, shared by
reference count, and only the rest is computed. Shared blocks are never written again: every block a request
writes lies past its hits, because hits are whole blocks and the last known token is always computed.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.kvcache.block_pool import BlockPool
from tokenmill.kvcache.prefix import extend_block_hashes


class HasBlocks(Protocol):
    block_ids: list[int]
    num_computed_tokens: int
    all_token_ids: list[int]
    cache_salt: str | None
    block_hashes: list[bytes]  # hashes of the full blocks of all_token_ids seen so far
    num_cached_blocks: int  # leading block_ids already offered to (or taken from) the prefix cache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # Tokens of admitted requests looked up in the prefix cache, and of them the ones found (vLLM's counters).
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_needed(self, request: HasBlocks, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def find_cached_prefix(self, request: HasBlocks) -> list[int]:
        """Cached blocks holding the longest run of the request's leading full blocks, not yet referenced; at most
        ``num_tokens - 1`` tokens, since the last known token is always computed (its logits pick the next)."""
        if not self.enable_prefix_caching or request.block_ids:
            return []
        tokens, size = request.all_token_ids, self.block_size
        hashes = extend_block_hashes(request.block_hashes, tokens, size, request.cache_salt)
        hits = []
        for i in range((len(tokens) - 1) // size):
            block_id = self.pool.lookup(hashes[i], tokens[i * size:(i + 1) * size])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, request: HasBlocks, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Grow the request's block table for ``num_new_tokens`` more tokens; False, changing nothing, if the pool
        is short. ``cached_blocks`` (from ``find_cached_prefix``, for a request with no blocks) first become its
        computed prefix: ``num_new_tokens`` then counts from their end."""
        if cached_blocks:
            assert not request.block_ids and request.num_computed_tokens == 0, "hits only for a request with no blocks"
            num_cached = len(cached_blocks) * self.block_size
            needed = cdiv(num_cached + num_new_tokens, self.block_size) - len(cached_blocks)
            revived = sum(self.pool.is_free(b) for b in cached_blocks)  # they leave the free list too
            if needed + revived > self.pool.num_free_blocks:
                return False
            for block_id in cached_blocks:
                self.pool.acquire(block_id)
            request.block_ids = list(cached_blocks) + self.pool.allocate(needed)
            request.num_computed_tokens = num_cached
            request.num_cached_blocks = len(cached_blocks)
            return True
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries_total += num_tokens
            self.prefix_hits_total += num_hit_tokens

    def cache_computed_blocks(self, request: HasBlocks) -> None:
        """Offer the request's full, computed blocks to the prefix cache; call after the step that computed them."""
        num_full = request.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= request.num_cached_blocks:
            return
        tokens, size = request.all_token_ids, self.block_size
        hashes = extend_block_hashes(request.block_hashes, tokens, size, request.cache_salt)
        for i in range(request.num_cached_blocks, num_full):
            self.pool.cache_block(request.block_ids[i], hashes[i], tokens[i * size:(i + 1) * size])
        request.num_cached_blocks = num_full

    def release_tail(self, request: HasBlocks) -> None:
        """Return the blocks past the one the request's next token goes to (blocks that held only rejected draft
        tokens); none is in the prefix cache, which holds only blocks computed in full."""
        keep = cdiv(request.num_computed_tokens + 1, self.block_size)
        if len(request.block_ids) > keep:
            self.pool.free(reversed(request.block_ids[keep:]))
            del request.block_ids[keep:]

    def free(self, request: HasBlocks) -> None:
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0
