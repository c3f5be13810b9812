"""What a model will take of the machine, estimated before it loads (no torch): its weights at the compute dtype
plus its KV cache budget on a CPU, its ``gpu_memory_utilization`` share on a GPU. server/fleet.py checks the
models of one server against the machine with it, so that a set that cannot fit fails at start with the name of the
model that does not fit, instead of one engine dying of memory later.

The estimate is an upper bound where the settings leave a choice open: ``dtype auto`` on a CPU counts 4 bytes a
weight (the start-up probe may pick float32), and a GGUF file kept quantized counts its dense copy too.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.models.paths import model_path

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Footprint:
    device: str  # "cpu" or "cuda"
    host_bytes: int  # of the machine's memory
    gpu_fraction: float  # of each GPU it uses (0 on a CPU)
    gpus: tuple[int, ...] = ()  # the GPUs it uses


def _safetensors_params(path: Path) -> int:
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def _gguf_params(path: Path) -> int:
    from tokenmill.models.gguf_file import read_gguf

    return sum(t.n_elements for t in read_gguf(path).tensors)


def _has_gpu() -> bool:
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def footprint(config: EngineConfig) -> Footprint:
    """The memory ``config``'s engine will take (ModelLoadError where its checkpoint is missing)."""
    path = model_path(config.model)
    device = "cuda" if config.device == "cuda" or (config.device == "auto" and _has_gpu()) else "cpu"
    if device == "cuda":
        gpus = tuple(config.devices or range(config.launch_tensor_parallel_size))
        return Footprint(device, 0, config.gpu_memory_utilization, gpus)
    if path.is_file():
        params, file_bytes = _gguf_params(path), path.stat().st_size
    else:
        params, file_bytes = _safetensors_params(path), 0
    weight_bytes = params * _DTYPE_BYTES.get(config.dtype, 4)
    if config.quantization != "none":
        weight_bytes += file_bytes  # the quantized tensors beside their dense copy
    return Footprint(device, weight_bytes + config.cpu_kv_cache_memory, 0.0)


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (the physical memory where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
