"""The one drafting interface: after each step's sampling, the model runner hands its proposer a ``DraftContext`` and
gets back drafts for every request that sampled; they travel back in the runner's output to the scheduler, which
schedules them with the request's next step (cut to the step's budget and the request's max_tokens; a grammar cuts
them to what it accepts).

The context is plain arrays and tensors -- no engine type -- so this package imports nothing above it. Row ``i`` of
the per-request arrays is the ``i``-th request that sampled this step, in step order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from tokenmill.kernels.metadata import AttentionMetadata


@dataclass
class DraftContext:
    # The requests that sampled, and every known token of theirs (this step's kept tokens included).
    rows: np.ndarray  # [R] their rows in token_ids
    num_kept: np.ndarray  # [R] tokens each kept this step: accepted drafts, then one sampled
    token_ids: np.ndarray  # [rows, max_len] known tokens per row (read only)
    num_tokens: np.ndarray  # [R] known tokens of each sampling request
    # The step's own layout, for a drafter that runs inside the model (MTP).
    positions: torch.Tensor  # [T] each computed token's position
    token_rows: np.ndarray  # [T] each computed token's row in token_ids
    token_positions: np.ndarray  # [T] host copy of positions
    attention: AttentionMetadata  # the step's attention layout (its KV slots)
    hidden: torch.Tensor  # [T, H] the model's output over the step's tokens
    last_indices: np.ndarray  # [R] flat index of each sampling request's last token (its drafts' come before)
    num_samples: np.ndarray  # [R] positions each sampled at: 1 + its drafts
    num_slots: np.ndarray  # [R] positions each request's blocks can hold (the scheduler may reserve past its tokens)
    # The layout of one-token steps at ``positions[i]`` for sampling requests ``indices[i]`` (into the R requests).
    decode_layout: Callable[[np.ndarray, np.ndarray], AttentionMetadata]

    def tokens(self, i: int) -> np.ndarray:
        """Sampling request ``i``'s known tokens."""
        return self.token_ids[self.rows[i], :self.num_tokens[i]]


class Proposer(Protocol):
    # Cache slots past a request's scheduled tokens that its drafting writes (the scheduler reserves them).
    num_lookahead_tokens: int

    def draft(self, ctx: DraftContext) -> list[list[int]]:
        """Drafts for each sampling request of ``ctx`` (called every step, also when none sampled)."""
        ...
