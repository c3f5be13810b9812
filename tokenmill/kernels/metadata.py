"""The flattened batch's attention layout, built once per step by the model runner and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # [T] int64: flat cache slot (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    # [B + 1] query offsets into the flattened batch (python ints: the reference loops over them).
    query_start_loc: list[int]
    # [B] tokens in the cache for each request once this step's tokens are written (context + new).
    seq_lens: list[int]
    # [B, max_blocks] int64 physical block ids, padded with the cache's null block.
    block_tables: torch.Tensor
    block_size: int
    # Indices of the requests whose chunk is a single token (decodes), batched together by the reference.
    decode_indices: list[int]
    # Indices of the other requests (prefill chunks), attended one by one.
    prefill_indices: list[int]
