"""The token embedding, split by vocabulary rows across tensor-parallel ranks (one rank: a plain embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.group import TensorParallel


def vocab_rows_per_rank(vocab_size: int, tp: TensorParallel) -> int:
    """Rows of the embedding and LM head one rank holds: ceil(V / size); the last rank's shard ends in zero rows."""
    return -(-vocab_size // tp.size)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp, self.rows = tp, vocab_rows_per_rank(vocab_size, tp)
        self.start = tp.rank * self.rows  # this rank's first token id
        self.weight = nn.Parameter(torch.empty(self.rows, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]: each rank embeds the ids in its rows, zeros elsewhere, then the sum."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def shard(self, vocab_size: int) -> slice:
        """The checkpoint rows (token ids) this rank loads."""
        return slice(self.start, min(vocab_size, self.start + self.rows))


def vocab_rows(dst: torch.Tensor, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows of ``dst`` (one rank's embedding or LM head) that the checkpoint rows ``tensor`` fill. Rows past them
    (the last shard's padding: no token id maps there) are zeroed; also returns how many elements they hold."""
    rows = tensor.shape[0]
    if rows >= dst.shape[0]:
        return dst, 0
    dst[rows:].zero_()
    return dst[:rows], dst[rows:].numel()
