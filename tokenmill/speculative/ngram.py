"""Prompt lookup (n-gram) drafts: when the last n tokens of a request occurred earlier in its own prompt or output,
propose the tokens that followed that earlier occurrence. Free to compute, and right whenever the output copies its
input (editing, summarizing with quotes, code, retrieval answers). The rule itself is pure Python + numpy.

For n from ``max_n`` down to ``min_n``, the most recent earlier occurrence of the last n tokens wins; the draft is up
to ``k`` tokens after it (fewer when the occurrence is near the end). No occurrence: no draft.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.speculative.proposer import DraftContext


class NgramProposer:
    def __init__(self, k: int, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {k}")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    num_lookahead_tokens = 0  # drafts are verified by the next step's own pass: nothing is written ahead

    def draft(self, ctx: DraftContext) -> list[list[int]]:
        return [self.propose(ctx.tokens(i)) for i in range(len(ctx.rows))]

    def propose(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to ``k`` (default self.k) draft tokens to follow ``token_ids``."""
        k = self.k if k is None else k
        if k < 1 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pattern = tokens[-n:]
            windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram, by its start
            starts = np.flatnonzero((windows == pattern).all(axis=1))
            if len(starts):
                follow = int(starts[-1]) + n  # the most recent occurrence
                return tokens[follow:follow + k].tolist()
        return []
