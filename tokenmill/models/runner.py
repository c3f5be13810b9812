"""SchedulerOutput -> one flattened forward pass -> logits of the requests that sample this step."""

from __future__ import annotations

import torch

from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import KVCache
from tokenmill.scheduler.request import Request
from tokenmill.scheduler.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.block_size = kv_cache.spec.block_size

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks: (input_ids [T], positions [T], metadata, rows of T that sample)."""
        input_ids: list[int] = []
        starts = [0]
        seq_lens, tables, sample_rows = [], [], []
        for chunk in out.chunks:
            req = chunk.request
            end = chunk.start + chunk.num_tokens
            input_ids.extend(req.all_token_ids[chunk.start:end])
            starts.append(starts[-1] + chunk.num_tokens)
            seq_lens.append(end)
            tables.append(req.block_ids)
            if chunk.samples:
                sample_rows.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        null = self.kv_cache.null_block
        block_tables = torch.tensor([t + [null] * (width - len(t)) for t in tables], dtype=torch.long)
        positions = torch.cat([torch.arange(c.start, c.start + c.num_tokens) for c in out.chunks])
        request_of_token = torch.repeat_interleave(torch.arange(len(out.chunks)),
                                                   torch.tensor([c.num_tokens for c in out.chunks]))
        slot_mapping = (block_tables[request_of_token, positions // self.block_size] * self.block_size
                        + positions % self.block_size)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device), query_start_loc=starts, seq_lens=seq_lens,
            block_tables=block_tables.to(self.device), block_size=self.block_size,
            decode_indices=[i for i, c in enumerate(out.chunks) if c.num_tokens == 1],
            prefill_indices=[i for i, c in enumerate(out.chunks) if c.num_tokens > 1])
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return ids, positions.to(self.device), meta, sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run the step; returns float32 logits [S, vocab] and the S requests they belong to, in order."""
        ids, positions, meta, sample_rows = self.prepare(out)
        hidden = self.model(ids, positions, meta, self.kv_cache)
        sampling = [c.request for c in out.chunks if c.samples]
        if not sampling:
            return torch.empty(0, 0), []
        return self.model.compute_logits(hidden[sample_rows]), sampling
