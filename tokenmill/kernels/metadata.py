"""The flattened batch's attention layout, built once per step by the model runner and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DeviceTensors:
    """The list fields of AttentionMetadata as int tensors on the model's device, for kernels (built once per step)."""
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    decode_rows: torch.Tensor  # [len(decode_indices)] int64: each decode's row in the flattened batch
    decode_seq_lens: torch.Tensor  # [len(decode_indices)] int32
    decode_block_tables: torch.Tensor  # [len(decode_indices), max_blocks]: the decodes' rows of block_tables


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
    # With several KV groups (kvcache/groups.py): each group's metadata (its own slot_mapping and block_tables, the
    # rest shared); self carries group 0's. Empty: one group, self.
    groups: tuple["AttentionMetadata", ...] = ()
    _tensors: DeviceTensors | None = field(default=None, repr=False, compare=False)
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        return self.groups[group] if self.groups else self

    def device_tensors(self, device: torch.device) -> DeviceTensors:
        """Built on first use and shared by every layer of the step (one host-to-device copy per step)."""
        if self._tensors is None:
            def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
                return torch.tensor(values, dtype=dtype, device=device)
            self._tensors = DeviceTensors(
                query_start_loc=as_tensor(self.query_start_loc, torch.int32),
                seq_lens=as_tensor(self.seq_lens, torch.int32),
                decode_rows=as_tensor([self.query_start_loc[i] for i in self.decode_indices], torch.int64),
                decode_seq_lens=as_tensor([self.seq_lens[i] for i in self.decode_indices], torch.int32),
                decode_block_tables=self.block_tables[self.decode_indices])
        return self._tensors

    def decode_max_len(self) -> int:
        """The longest sequence among the decodes (host side; sizes the split-KV grid)."""
        return self.derived("decode_max_len", lambda: max(self.seq_lens[i] for i in self.decode_indices))

    def derived(self, key, build):
        """``build()`` once per step for ``key``, shared by every layer (e.g. a kernel's work list)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]
