"""The KV cache tensors: one ``data`` (and, for fp8, ``scales``) tensor per layer of a KV group, laid out as
kvcache/spec.py says; layers of the same rank in different groups (kvcache/groups.py) share a tensor, each group
writing only the blocks its own tables hold.

Each tensor has ``num_blocks + 1`` blocks: block ``num_blocks`` is the null block, all zeros, never in the
pool; padded block-table entries point at it so that padded reads yield finite zeros. Every other position holds
zeros or what a request wrote there (finite either way), so masked reads of a block's unused positions stay finite.
"""

from __future__ import annotations

import math
import mmap

import torch

from tokenmill.kvcache.populate import MODES, populate_on_threads
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
        data = [zeros(shape, dtype, device) for _ in range(groups.group_size)]
        scales = [zeros(shape[:3], torch.float32, device) if spec.quantized else None
                  for _ in range(groups.group_size)]
        # Per layer (the attention ops index them by layer): its group's tensor of its rank.
        self.data = [data[i] for i in groups.tensor_of_layer]
        self.scales: list[torch.Tensor | None] = [scales[i] for i in groups.tensor_of_layer]
        self.group_of_layer = groups.group_of_layer
        self._tensors = data + [t for t in scales if t is not None]
        self.populated_bytes = 0  # made resident by populate() (kvcache/populate.py)

    def populate(self, mode: str, threads: int = 1) -> None:
        """Make the CPU tensors' pages resident as kvcache/populate.py's ``mode`` says (a GPU cache has nothing to
        do). Called after the engine's start-up timings and compilation, which it would disturb."""
        if mode not in MODES:
            raise ValueError(f"kv_cache_populate={mode!r}: one of {MODES}")
        regions = [(t.data_ptr(), t.nbytes) for t in self._tensors if t.device.type == "cpu" and t.nbytes]
        if mode == "startup" and regions:
            self.populated_bytes = populate_on_threads(regions, threads)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.data[i], self.scales[i]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros. On a CPU its memory is an anonymous mapping, whose pages the OS zero-fills as each is first
    touched: nothing is written now, and blocks never used never become resident (torch.zeros writes every page at
    start-up, in time that grows with the cache: 1.3-2.3 s for 512 MiB in a server's engine process on a 2-core VM).
    KVCache.populate makes them all resident before the engine is ready, unless kv_cache_populate=lazy
    (kvcache/populate.py)."""
    if torch.device(device).type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)  # the tensor keeps it alive
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)
