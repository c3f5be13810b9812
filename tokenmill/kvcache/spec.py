"""What one token costs in the KV cache, and the cache's byte layout.

Layout, per cache tensor (one per layer of a KV group, shared by the groups: kvcache/groups.py):
``data[num_blocks + 1, block_size, num_slots, slot_dim]`` in the storage dtype and, for fp8,
``scales[num_blocks + 1, block_size, num_slots]`` float32 (the extra block is the zero null block). A *slot* is one
independently scaled vector per token:
- GQA/MHA: ``num_slots = 2 * num_kv_heads`` (K heads first, then V heads), ``slot_dim = head_dim``;
- MLA: one slot holding the latent ``c_kv`` and the roped key ``k_pe`` side by side.
fp8 is float8_e4m3fn with one float32 scale per (token, slot): ``value ~= fp8 * scale``, scale = amax / 448.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenmill.kvcache.groups import KVGroups

KVCacheDtype = Literal["fp8", "bf16", "fp16", "fp32"]

ELEMENT_BYTES: dict[str, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
SCALE_BYTES = 4  # one float32 per (token, slot) when the cache is fp8


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_slots: int
    slot_dim: int
    dtype: KVCacheDtype
    block_size: int
    groups: KVGroups | None = None  # None: one group of every layer (set so by __post_init__)

    def __post_init__(self) -> None:
        if self.groups is None:
            object.__setattr__(self, "groups", KVGroups.single(self.num_layers))
        assert self.groups.num_layers == self.num_layers, "every layer in exactly one KV group"

    @classmethod
    def for_gqa(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: KVCacheDtype,
                block_size: int, layer_windows: tuple[int, ...] = ()) -> "KVCacheSpec":
        groups = KVGroups.for_layers(layer_windows) if layer_windows else KVGroups.single(num_layers)
        return cls(num_layers, 2 * num_kv_heads, head_dim, dtype, block_size, groups)

    @property
    def quantized(self) -> bool:
        return self.dtype == "fp8"

    @property
    def bytes_per_token_per_layer(self) -> int:
        scale = SCALE_BYTES if self.quantized else 0
        return self.num_slots * (self.slot_dim * ELEMENT_BYTES[self.dtype] + scale)

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K/V of one token: what a request costs per token without windows."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        """One block of the pool: ``block_size`` tokens in each of a group's cache tensors (kvcache/groups.py)."""
        return self.block_size * self.groups.group_size * self.bytes_per_token_per_layer

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """What one request of ``num_tokens`` tokens holds while it decodes (window groups hold only their window)."""
        return self.groups.blocks_for(num_tokens, self.block_size) * self.bytes_per_block

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block
