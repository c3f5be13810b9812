"""The KV cache tensors: one ``data`` (and, for fp8, ``scales``) tensor per layer of a KV group, laid out as
kvcache/spec.py says; layers of the same rank in different groups (kvcache/groups.py) share a tensor, each group
writing only the blocks its own tables hold.

Each tensor has ``num_blocks + 1`` blocks: block ``num_blocks`` is the null block, all zeros, never in the
pool; padded block-table entries point at it so that padded reads yield finite zeros.
"""

from __future__ import annotations

import torch

from tokenmill.kvcache.spec import KVCacheSpec

STORAGE_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str):
        self.spec = spec
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        shape = (num_blocks + 1, spec.block_size, spec.num_slots, spec.slot_dim)
        dtype = STORAGE_DTYPES[spec.dtype]
        groups = spec.groups
        data = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(groups.group_size)]
        scales = [torch.zeros(shape[:3], dtype=torch.float32, device=device) if spec.quantized else None
                  for _ in range(groups.group_size)]
        # Per layer (the attention ops index them by layer): its group's tensor of its rank.
        self.data = [data[i] for i in groups.tensor_of_layer]
        self.scales: list[torch.Tensor | None] = [scales[i] for i in groups.tensor_of_layer]
        self.group_of_layer = groups.group_of_layer
        self._tensors = data + [t for t in scales if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.data[i], self.scales[i]
