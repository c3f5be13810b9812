"""Drafts from DeepSeek-V3's multi-token-prediction (MTP) module (models/deepseek.py: ``DeepseekMTP``), run by the
model runner right after each step's forward pass and sampling.

The module at position i reads the main model's hidden state h_i and the token at i+1, and predicts the token at i+2;
its attention keeps a cache layer of its own. After every step:

1. **Catch up.** The module runs over every position the step computed, in the step's own layout (its attention
   metadata and cache slots): position p reads the token at p+1 -- the next prompt token inside a prompt, an accepted
   draft, or the token sampled at the end. That fills the module's cache for those positions. Positions after a
   request's last kept position read a rejected draft: their entries are wrong and never read, because the next
   step computes those positions again (the main model and then this pass) before anything attends past them.
2. **First draft.** A request that sampled drafts the token after the one it just sampled from the module's output at
   its last kept position (the position whose next token was just sampled).
3. **Further drafts.** Draft j+1 feeds draft j and the module's own output back in at the next position, as a batch of
   one-token decodes. Their cache slots lie past the request's computed tokens, in blocks the scheduler reserved
   (``num_lookahead_tokens``); the next step overwrites them too. A request whose blocks end sooner drafts fewer.

Drafts are the module's greedy tokens: a point-mass proposal, for which the runner's acceptance rule is exact
rejection sampling, so outputs keep the target distribution whatever the drafts' quality.

Prefix caching: the module's entry at a block's last position read the next block's first token, so a request that
hits the block but continues differently inherits a slightly wrong entry there. That can only cost acceptance, never
change an output.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.kvcache.cache import KVCache
from tokenmill.speculative.proposer import DraftContext


class MTPDrafter:
    def __init__(self, k: int, model: torch.nn.Module, kv_cache: KVCache):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {k}")
        self.k, self.model, self.kv_cache = k, model, kv_cache

    @property
    def num_lookahead_tokens(self) -> int:
        """Cache slots past a request's scheduled tokens that its further drafts write."""
        return self.k - 1

    def draft(self, ctx: DraftContext) -> list[list[int]]:
        """Drafts for each sampling request of ``ctx`` (its kept tokens already among its known tokens)."""
        model, hidden = self.model, ctx.hidden
        width = ctx.token_ids.shape[1]
        next_ids = ctx.token_ids[ctx.token_rows, np.minimum(ctx.token_positions + 1, width - 1)]
        out = model.mtp_forward(torch.from_numpy(next_ids.astype(np.int64)).to(hidden.device), ctx.positions,
                                hidden, ctx.attention, self.kv_cache)
        if not len(ctx.rows):
            return []
        last_kept = ctx.last_indices - (ctx.num_samples - ctx.num_kept)
        previous = out[torch.from_numpy(last_kept).to(hidden.device)]  # [R, H]
        tokens = model.mtp_greedy(previous)
        positions = ctx.num_tokens - 2  # each request's last kept position
        drafts, active = [tokens], np.arange(len(ctx.rows))  # drafts[j][i]: draft j of request active_j[i]
        actives = [active]
        for _ in range(1, self.k):
            positions = positions + 1
            keep = np.flatnonzero(positions[active] < ctx.num_slots[active])
            if not len(keep):
                break
            index = torch.from_numpy(keep).to(hidden.device)
            active, tokens, previous = active[keep], tokens[index], previous[index]
            meta = ctx.decode_layout(active, positions[active])
            previous = model.mtp_forward(tokens, torch.from_numpy(positions[active]).to(hidden.device), previous,
                                         meta, self.kv_cache)
            tokens = model.mtp_greedy(previous)
            drafts.append(tokens)
            actives.append(active)
        result: list[list[int]] = [[] for _ in ctx.rows]
        for rows_j, tokens_j in zip(actives, _split(drafts)):
            for i, token in zip(rows_j.tolist(), tokens_j):
                result[i].append(token)
        return result


def _split(drafts: list[torch.Tensor]) -> list[list[int]]:
    """Per-iteration draft tensors -> lists, with one device-to-host copy."""
    flat = torch.cat(drafts).tolist()
    out, start = [], 0
    for tokens in drafts:
        out.append(flat[start:start + len(tokens)])
        start += len(tokens)
    return out
