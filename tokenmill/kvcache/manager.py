"""Block tables per request and KV group, on top of the BlockPool, and prefix caching. Pure Python.

A request has one block table per KV group (kvcache/groups.py), all of one logical length: block ``b`` of every table
covers positions ``b * block_size ..``. Its tables always cover at least its ``num_computed_tokens``;
``allocate_slots`` extends them to cover the tokens a step is about to compute. In a window group, the blocks wholly
behind the window of the next query go back to the pool after each step (``free_behind_window``); their entries
become ``null_block``, which no pool block is.

Prefix caching (on unless ``enable_prefix_caching=False``): once a step has computed a request's block in full, each
group's block is offered to the pool's hash map under its chained hash (kvcache/prefix.py) salted by the group. A
request being admitted (nothing computed) first looks up its leading full blocks; a hit of ``h`` blocks needs all
``h`` in every full group and, in a window group, those the next query's window reaches. The hits become its
computed prefix, shared by reference count, and only the rest is computed. Shared blocks are never written again:
every block a request writes lies past its hits, because hits are whole blocks and the last known token is always
computed.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.kvcache.block_pool import BlockPool
from tokenmill.kvcache.groups import KVGroups
from tokenmill.kvcache.prefix import extend_block_hashes


class HasBlocks(Protocol):
    block_tables: list[list[int]]  # one per KV group; [] while it holds no block
    num_computed_tokens: int
    all_token_ids: list[int]
    cache_salt: str | None
    block_hashes: list[bytes]  # hashes of the full blocks of all_token_ids seen so far
    num_cached_blocks: int  # leading blocks (of every table) already offered to (or taken from) the prefix cache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: KVGroups | None = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.null_block = num_blocks  # the cache's zero block (kvcache/cache.py); never in the pool
        self.groups = groups or KVGroups.single(1)  # one full-attention table (the layers do not matter here)
        self.enable_prefix_caching = enable_prefix_caching
        # Tokens of admitted requests looked up in the prefix cache, and of them the ones found (vLLM's counters).
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0

    @property
    def num_groups(self) -> int:
        return self.groups.num_groups

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool's blocks hold, in one group's tables (a request holds a block per group and position)."""
        return self.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.usage

    def empty_tables(self) -> list[list[int]]:
        return [[] for _ in range(self.num_groups)]

    def num_blocks_of(self, request: HasBlocks) -> int:
        """The logical length of the request's tables."""
        return len(request.block_tables[0]) if request.block_tables else 0

    def live_from(self, request: HasBlocks) -> list[int]:
        """Per group, the first block the request still holds (entries before it are null: behind the window)."""
        return [self.groups.first_live_block(g, request.num_computed_tokens, self.block_size)
                for g in range(self.num_groups)]

    def _key(self, block_hash: bytes, group: int) -> bytes:
        return block_hash + group.to_bytes(4, "little") if group else block_hash

    def find_cached_prefix(self, request: HasBlocks) -> list[list[int]]:
        """Per group, the cached blocks of the longest run of the request's leading full blocks that every group
        holds (a window group: the blocks the next query's window reaches; null before them), not yet referenced;
        at most ``num_tokens - 1`` tokens, since the last known token is always computed (its logits pick the next).
        Empty: no hit."""
        if not self.enable_prefix_caching or request.block_tables:
            return []
        tokens, size = request.all_token_ids, self.block_size
        hashes = extend_block_hashes(request.block_hashes, tokens, size, request.cache_salt)

        def lookup(group: int, i: int) -> int | None:
            return self.pool.lookup(self._key(hashes[i], group), tokens[i * size:(i + 1) * size])

        longest = (len(tokens) - 1) // size
        runs: dict[int, list[int]] = {}  # full group -> its leading cached blocks
        for group, window in enumerate(self.groups.windows):
            if not window:
                run = runs[group] = []
                while len(run) < longest and (block_id := lookup(group, len(run))) is not None:
                    run.append(block_id)
                longest = len(run)
        for num_hits in range(longest, 0, -1):  # the longest run whose windows are cached too
            tables = []
            for group in range(self.num_groups):
                if group in runs:
                    tables.append(runs[group][:num_hits])
                    continue
                first = self.groups.first_live_block(group, num_hits * size, size)
                table = [self.null_block] * first + [lookup(group, i) for i in range(first, num_hits)]
                if None in table:
                    break
                tables.append(table)
            else:
                return tables
        return []

    def allocate_slots(self, request: HasBlocks, num_new_tokens: int,
                       cached_blocks: list[list[int]] | None = None) -> bool:
        """Grow the request's block tables for ``num_new_tokens`` more tokens; False, changing nothing, if the pool
        is short. ``cached_blocks`` (from ``find_cached_prefix``, for a request with no blocks) first become its
        computed prefix: ``num_new_tokens`` then counts from their end."""
        if cached_blocks:
            assert not request.block_tables and request.num_computed_tokens == 0, "hits only without blocks"
            num_hit_blocks = len(cached_blocks[0])
            num_cached = num_hit_blocks * self.block_size
            needed = (cdiv(num_cached + num_new_tokens, self.block_size) - num_hit_blocks) * self.num_groups
            held = [b for table in cached_blocks for b in table if b != self.null_block]
            revived = sum(self.pool.is_free(b) for b in held)  # they leave the free list too
            if needed + revived > self.pool.num_free_blocks:
                return False
            for block_id in held:
                self.pool.acquire(block_id)
            request.block_tables = [list(table) for table in cached_blocks]
            request.num_computed_tokens = num_cached
            request.num_cached_blocks = num_hit_blocks
            return self.allocate_slots(request, num_new_tokens)
        end = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        needed = max(0, end - self.num_blocks_of(request))
        if needed * self.num_groups > self.pool.num_free_blocks:
            return False
        if not request.block_tables:
            request.block_tables = self.empty_tables()
        for table in request.block_tables:
            table.extend(self.pool.allocate(needed))
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
        for group, table in enumerate(request.block_tables):
            for i in range(request.num_cached_blocks, num_full):
                if table[i] != self.null_block:
                    self.pool.cache_block(table[i], self._key(hashes[i], group), tokens[i * size:(i + 1) * size])
        request.num_cached_blocks = num_full

    def free_behind_window(self, request: HasBlocks) -> None:
        """Return each window group's blocks that the next query's window no longer reaches (cache them first:
        ``cache_computed_blocks``, so that a later prefix hit can revive them)."""
        for group, table in enumerate(request.block_tables):
            first = self.groups.first_live_block(group, request.num_computed_tokens, self.block_size)
            start = first  # entries before the last step's first live block are null already: scan back to them
            while start > 0 and table[start - 1] != self.null_block:
                start -= 1
            if start < first:
                self.pool.free(table[start:first])
                table[start:first] = [self.null_block] * (first - start)

    def release_tail(self, request: HasBlocks) -> None:
        """Return the blocks past the one the request's next token goes to (blocks that held only rejected draft
        tokens); none is in the prefix cache, which holds only blocks computed in full."""
        keep = cdiv(request.num_computed_tokens + 1, self.block_size)
        for table in request.block_tables:
            if len(table) > keep:
                self.pool.free(reversed(table[keep:]))
                del table[keep:]

    def check_tables(self, request: HasBlocks, holders: list[int]) -> None:
        """Assert a running request's tables are sound (one length, every live position backed by a block, no block
        twice, leading cached blocks holding its tokens); count each block it holds into ``holders``."""
        size = self.block_size
        held = [b for table in request.block_tables for b in table if b != self.null_block]
        assert len(set(held)) == len(held), "a request holds a block twice"
        assert len({len(t) for t in request.block_tables}) == 1, "tables of different lengths"
        assert self.num_blocks_of(request) * size >= request.num_computed_tokens, "computed tokens without blocks"
        for table, live_from in zip(request.block_tables, self.live_from(request)):
            assert self.null_block not in table[live_from:], "a live position without a block"
            for i, block_id in enumerate(table):
                if block_id == self.null_block:
                    continue
                holders[block_id] += 1
                tokens = self.pool.blocks[block_id].token_ids
                if i < request.num_cached_blocks and tokens is not None:
                    assert list(tokens) == request.all_token_ids[i * size:(i + 1) * size], "cache mismatch"

    def free(self, request: HasBlocks) -> None:
        for table in request.block_tables:
            self.pool.free(b for b in reversed(table) if b != self.null_block)
        request.block_tables = []
        request.num_cached_blocks = 0
