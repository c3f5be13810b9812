"""Build the model on its device and size the KV cache from the memory budget."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.distributed.group import TensorParallel
from tokenmill.kernels.backend import KernelChoice, resolve_kernel_backend
from tokenmill.kvcache.cache import KVCache
from tokenmill.models.config import ModelConfig
from tokenmill.models.loader import Checkpoint, ModelLoadError
from tokenmill.models.registry import model_class_for

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    kv_cache: KVCache
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    kernel_backend: str = "torch"


def dtype_name(dtype: torch.dtype) -> str:
    """The configuration's name of a compute dtype (``resolve_dtype``'s inverse)."""
    return next(name for name, d in _DTYPES.items() if d == dtype)


def resolve_dtype(config: EngineConfig, device: torch.device, shape: tuple[int, int] = (1536, 576)) -> torch.dtype:
    """``auto``: bfloat16 on CUDA; on a CPU the faster of bfloat16 and float32 for a linear layer of ``shape``
    (out, in), measured here and now. CPUs differ by an order of magnitude: with AMX (Intel Xeon) bfloat16 was 2x
    float32 at batch 1, while an AVX2-only AMD EPYC runs bfloat16 GEMMs 1.4x (M=1) to 8.5x (M=256) slower."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cuda":
        return torch.bfloat16
    ratios = bf16_over_fp32_time(*shape)
    dtype = torch.bfloat16 if math.prod(ratios.values()) ** (1 / len(ratios)) < 1.0 else torch.float32
    log.info("dtype auto -> %s (bfloat16 / float32 time of a %dx%d linear layer: %s)", dtype, *shape,
             ", ".join(f"M={m}: {r:.2f}" for m, r in ratios.items()))
    return dtype


def bf16_over_fp32_time(out_features: int, in_features: int, rows: tuple[int, ...] = (1, 16, 256),
                        repeats: int = 5) -> dict[int, float]:
    """Best-of-``repeats`` time of ``F.linear`` in bfloat16 over float32, per batch of ``rows`` rows."""
    ratios = {}
    for m in rows:
        best = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, in_features, dtype=dtype), torch.randn(out_features, in_features, dtype=dtype)
            torch.nn.functional.linear(x, w)  # warm-up: first calls pick kernels, fault pages in
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                torch.nn.functional.linear(x, w)
                times.append(time.perf_counter() - start)
            best[dtype] = min(times)
        ratios[m] = best[torch.bfloat16] / best[torch.float32]
    return ratios


def _kv_budget(config: EngineConfig, device: torch.device) -> int:
    if device.type != "cuda":
        return config.kv_cache_memory
    free, total = torch.cuda.mem_get_info(device)
    return int(total * config.gpu_memory_utilization) - (total - free)


def kernel_choice(config: EngineConfig, device: torch.device, fp8_weights: bool) -> KernelChoice:
    try:
        backend = resolve_kernel_backend(config.kernel_backend, device,
                                         fp8=fp8_weights or config.resolved_kv_cache_dtype() == "fp8")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    tuner = None
    if backend == "triton" and config.kernel_tuning == "autotune":
        from tokenmill.kernels.triton.moe_config import MoETuner

        tuner = MoETuner(Path(config.kernel_cache_dir).expanduser())
    log.info("kernel backend: %s%s", backend, " (autotuned MoE configs)" if tuner else "")
    return KernelChoice(backend, tuner)


def load_model_and_cache(checkpoint: Checkpoint, model_config: ModelConfig, config: EngineConfig,
                         tp: TensorParallel = TensorParallel()) -> LoadedModel:
    """This rank's model (its shard of every weight, read straight into the compute dtype on its device) and KV
    cache; with several ranks, every rank gets the same number of blocks (the smallest any rank's memory allows)."""
    device = tp.device if tp.size > 1 else torch.device(config.resolved_device())
    dtype = resolve_dtype(config, device, (model_config.intermediate_size, model_config.hidden_size))
    kernels = kernel_choice(config, device, fp8_weights=model_config.fp8_weight_block is not None)
    drafting = config.speculative_method == "mtp"
    if drafting and not model_config.num_mtp_layers:
        raise ConfigError(f"--speculative-method mtp needs a checkpoint with a multi-token-prediction layer "
                          f"(DeepSeek-V3's num_nextn_predict_layers); {checkpoint.path} has none")
    try:
        model_cls = model_class_for(model_config)
        extra = {"mtp": True} if drafting else {}
        if tp.size > 1:  # engine/ranks.py checked that the model splits
            extra["tp"] = tp
        with torch.device("meta"):
            model = model_cls(model_config, kernels=kernels, **extra)
        # Materialized on the device in the compute dtype; each checkpoint tensor is converted as it is copied in.
        model.cast_parameters(dtype).to_empty(device=device)
        model.rotary.to(device)
        model.load_weights(checkpoint.weights(model.weight_shard))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"cannot build the model from {checkpoint.path}: {exc}") from None
    model.eval()

    spec = model.kv_cache_spec(config.resolved_kv_cache_dtype(), config.block_size)
    num_blocks = tp.min(spec.num_blocks_for(_kv_budget(config, device)) - 1)  # less the cache's null block
    capacity = num_blocks * spec.block_size
    max_model_len = config.max_model_len or model.max_position
    if max_model_len > model.max_position:
        raise ConfigError(f"max_model_len={max_model_len} is beyond the model's {model.max_position} positions")
    if capacity < max_model_len:
        if config.max_model_len:
            raise ConfigError(f"kv_cache_memory holds {capacity} tokens ({spec.bytes_per_token} bytes each), fewer "
                              f"than max_model_len={max_model_len}: raise kv_cache_memory or lower max_model_len")
        max_model_len = capacity
        log.warning("max_model_len lowered to %d: the KV cache holds no more", capacity)
    if num_blocks < 1:
        raise ConfigError("kv_cache_memory is too small for a single KV block")
    return LoadedModel(model, KVCache(spec, num_blocks, device), device, dtype, max_model_len, kernels.backend)
