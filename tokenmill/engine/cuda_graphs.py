"""Decode steps as captured CUDA graphs: a small model's eager decode is launch-bound (hundreds of kernel launches per
step), a replayed graph is one launch.

At start-up the model's forward over a pure-decode batch is captured once per batch size of ``batch_sizes``
(largest first, sharing one memory pool). A later step whose every request computes one token (no prefill chunk, no
drafts) and whose batch fits replays the graph of the smallest size that holds it:

- its inputs are copied into the graphs' static buffers; the rows past the batch are padding: token 0 at position 0,
  KV-write slot -1 (kernels skip it), a one-token context in the null block (zeros), so they cost a little compute and
  touch nothing;
- everything a kernel takes from the host is fixed per size: the decode split count comes from ``max_model_len``,
  never from the step's longest context, so no Triton variant compiles after capture;
- rows [:B] of the graph's output are the step's hidden states.

Anything else runs eagerly, as does everything with ``enforce_eager``. ``capture=False`` keeps the static buffers and
the padding but runs the forward eagerly over them: the CPU tests prove that plumbing equal to plain eager steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from tokenmill.kernels.metadata import AttentionMetadata, DeviceTensors
from tokenmill.kvcache.cache import KVCache

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured sizes: the ladder up to max_num_seqs (which is captured itself when it is under 256)."""
    top = min(max_num_seqs, BATCH_SIZES[-1])
    return [b for b in BATCH_SIZES if b < top] + [top]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_num_seqs: int, max_model_len: int,
                 capture: bool = True):
        self.model, self.kv_cache, self.max_model_len, self.capture_graphs = model, kv_cache, max_model_len, capture
        self.sizes = graph_batch_sizes(max_num_seqs)
        device, top = kv_cache.data[0].device, self.sizes[-1]
        block_size = kv_cache.spec.block_size
        self.null_block = kv_cache.null_block
        width = -(-max_model_len // block_size)
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(top, **long)
        self.positions = torch.zeros(top, **long)
        groups = kv_cache.spec.groups.num_groups  # per KV group (kvcache/groups.py): its slots and tables
        self.slot_mapping = torch.full((groups, top), -1, **long)
        self.block_tables = torch.full((groups, top, width), self.null_block, **long)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.metas = {b: self._meta(b, block_size) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_runs = 0  # steps served from the static buffers (a graph replay, or the eager stand-in)

    def _meta(self, size: int, block_size: int) -> AttentionMetadata:
        """Attention metadata of ``size`` decodes whose device tensors are views of the static buffers."""
        groups = [self._group_meta(g, size, block_size) for g in range(len(self.slot_mapping))]
        if len(groups) == 1:
            return groups[0]
        meta = dataclasses.replace(groups[0], groups=tuple(groups))
        meta._tensors, meta._derived = groups[0]._tensors, {"decode_max_len": self.max_model_len}
        return meta

    def _group_meta(self, group: int, size: int, block_size: int) -> AttentionMetadata:
        device, tables = self.input_ids.device, self.block_tables[group, :size]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[group, :size], query_start_loc=list(range(size + 1)),
            seq_lens=[self.max_model_len] * size, block_tables=tables, block_size=block_size,
            decode_indices=list(range(size)), prefill_indices=[])
        meta._tensors = DeviceTensors(
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device), seq_lens=self.seq_lens[:size],
            decode_rows=torch.arange(size, device=device), decode_seq_lens=self.seq_lens[:size],
            decode_block_tables=tables)
        meta._derived["decode_max_len"] = self.max_model_len  # fixes the split count per size
        return meta

    def _reset_derived(self, size: int) -> None:
        """Per-step caches start afresh (the eager stand-in reuses the metadata objects)."""
        meta = self.metas[size]
        for m in (meta, *meta.groups):
            m._derived = {"decode_max_len": self.max_model_len}

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.metas[size], self.kv_cache)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (a warm-up run first: it compiles the kernels); returns the seconds it took."""
        start = time.perf_counter()
        if not self.capture_graphs:
            return 0.0
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.sizes, seconds)
        return seconds

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states [B, H] from a graph, or None when the step is not a pure decode that fits."""
        batch = len(meta.decode_indices)
        if meta.prefill_indices or not batch or batch > self.sizes[-1] or input_ids.shape[0] != batch:
            return None
        size = next(s for s in self.sizes if s >= batch)
        self.num_runs += 1
        tensors = meta.device_tensors(input_ids.device)
        width = meta.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        for g in range(len(self.slot_mapping)):
            group = meta.for_group(g)
            self.slot_mapping[g, :batch].copy_(group.slot_mapping)
            self.block_tables[g, :batch, :width].copy_(group.block_tables)
        self.seq_lens[:batch].copy_(tensors.seq_lens)
        if size > batch:  # padding rows: see the module docstring
            self.input_ids[batch:size].zero_()
            self.positions[batch:size].zero_()
            self.slot_mapping[:, batch:size].fill_(-1)
            self.seq_lens[batch:size].fill_(1)
            self.block_tables[:, batch:size, 0].fill_(self.null_block)
        if not self.capture_graphs:
            self._reset_derived(size)
            return self._forward(size)[:batch]
        self.graphs[size].replay()
        return self.outputs[size][:batch]
