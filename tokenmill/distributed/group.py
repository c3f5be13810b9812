"""One rank's place in a tensor-parallel group, and the collectives a sharded model calls.

Every rank runs the same model code over its shard of each weight (models/llama.py says which shard); a layer whose
output is a partial sum (the attention output projection, the MLP's down projection, the vocab-parallel embedding)
all-reduces it, and the LM head's vocabulary shards are gathered so that every rank holds the same logits. Sampling
then gives every rank the same tokens (same logits, same seeds), so the ranks' persistent batches never diverge and
only rank 0 reports.

The group is a process group object of its own (gloo on a CPU, NCCL on CUDA) over a TCP store, not torch's global
default group: several engines can live in one process (tests, an LLM beside a server). With ``size == 1`` every
collective is the identity and nothing distributed exists.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# How long a collective may wait for a peer that is alive but silent; a peer that dies fails it at once (gloo and
# NCCL see the closed connection).
TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    group: Any = field(default=None, compare=False, repr=False)  # the ProcessGroup; None when size == 1

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> "TensorParallel":
        """Rendezvous of ``size`` ranks over ``store`` (blocks until all have joined)."""
        if device.type == "cuda":
            group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, TIMEOUT)
        return cls(rank, size, device, group)

    def span(self, n: int) -> tuple[int, int]:
        """This rank's contiguous share [start, end) of ``n`` rows split evenly (``n`` divisible by ``size``)."""
        per_rank = n // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """The ranks' ``x`` reduced by ``op``, in place."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self.group.allreduce([x], opts).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n]: the ranks' pieces side by side, in rank order."""
        if self.size == 1:
            return x
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([pieces], [x.contiguous()]).wait()
        return torch.cat(pieces, dim=-1)

    def min(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN))

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; other ranks pass nothing)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        payload = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.group.broadcast([size], opts).wait()
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device) if self.rank == 0 \
            else torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self.group.broadcast([data], opts).wait()
        return obj if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())
