"""KV cache groups: layers grouped by attention kind, each group with its own block table (vLLM's hybrid allocator).
Pure Python: never imports torch.

A sliding-window layer never reads a key more than ``window - 1`` positions behind its query, so its blocks that fall
wholly behind the window can return to the pool while the request runs. Layers of different kinds (full attention,
a window of 128, of 1024, ...) therefore need different numbers of blocks, and cannot share one block table.

Layout: the layers are split into groups of at most ``group_size`` layers of one kind. One block of the shared pool
is ``block_size`` tokens in each of ``group_size`` cache tensors; the group holding the block uses the page of its
i-th layer in tensor i (so layer ``l`` lives in tensor ``tensor_of_layer[l]``, shared with the layers of the same
rank in the other groups). A request has one block table per group, all of the same logical length (block ``b``
covers positions ``b * block_size ..``); in a window group, entries behind the window are the null block.

A model without windows is one group of all its layers: one table, one tensor per layer, as before groups existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

# Grouping prefers larger groups (fewer tables to keep per request and step) when they cost at most this much more
# memory than the tightest grouping, at a context of REFERENCE_WINDOWS times the largest window.
PADDING_TOLERANCE = 0.05
REFERENCE_WINDOWS = 8


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: its layers' window (0: full attention)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, at most group_size of them
    group_size: int  # cache tensors: layers per block

    @classmethod
    def single(cls, num_layers: int) -> "KVGroups":
        return cls((0,), (tuple(range(num_layers)),), num_layers)

    @classmethod
    def for_layers(cls, layer_windows: tuple[int, ...] | list[int]) -> "KVGroups":
        """Group layers of one window value into groups of a common size, the size that pads the least memory
        at a long context (within PADDING_TOLERANCE, the largest such size)."""
        kinds: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1 and 0 in kinds:
            return cls.single(len(layer_windows))
        context = REFERENCE_WINDOWS * max(kinds)

        def padded_tokens(size: int) -> int:  # tokens held per position of a long request, padding included
            return sum(ceil(len(ls) / size) * size * (min(w, context) if w else context) for w, ls in kinds.items())

        sizes = range(1, max(len(ls) for ls in kinds.values()) + 1)
        best = min(padded_tokens(s) for s in sizes)
        size = max(s for s in sizes if padded_tokens(s) <= best * (1 + PADDING_TOLERANCE))
        windows, layers = [], []
        for window in sorted(kinds):  # full attention first
            members = kinds[window]
            for start in range(0, len(members), size):
                windows.append(window)
                layers.append(tuple(members[start:start + size]))
        return cls(tuple(windows), tuple(layers), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return sum(len(ls) for ls in self.layers)

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g, members in enumerate(self.layers):
            for layer in members:
                out[layer] = g
        return tuple(out)

    @property
    def tensor_of_layer(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for members in self.layers:
            for i, layer in enumerate(members):
                out[layer] = i
        return tuple(out)

    def first_live_block(self, group: int, num_computed_tokens: int, block_size: int) -> int:
        """The first block the group still needs once ``num_computed_tokens`` are computed: the next query (at
        position num_computed_tokens) sees keys from ``num_computed_tokens - window + 1`` on."""
        window = self.windows[group]
        return max(0, num_computed_tokens - window + 1) // block_size if window else 0

    def blocks_for(self, num_tokens: int, block_size: int, num_new_tokens: int = 1) -> int:
        """Blocks, over all groups, that a request holds at most while computing ``num_new_tokens`` tokens that end
        at ``num_tokens``: full groups cover every token, window groups the window behind the chunk and the chunk."""
        total = 0
        for window in self.windows:
            end = -(-num_tokens // block_size)
            start = 0
            if window:
                start = max(0, num_tokens - num_new_tokens - window + 1) // block_size
            total += end - start
        return total

    def max_tokens_for(self, num_blocks: int, block_size: int, limit: int, chunk: int = 1) -> int:
        """The longest request, up to ``limit`` tokens, that ``num_blocks`` blocks hold alone, prefilled in chunks of
        up to ``chunk`` tokens (a model whose every layer has a window holds any length in bounded blocks)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid, block_size, min(chunk, mid)) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo
