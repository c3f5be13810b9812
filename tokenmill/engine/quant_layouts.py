"""The quantized layers' weight layouts, settled at start-up (models/quantization.py names the candidates;
engine/build.py applies the table).

Each candidate (shape, format) of a checkpoint's own quantized weights is timed against its shape's dense layout
(engine/layouts.py: the same cold copies, interleaved samples and fastest-of ratio), giving ``dense_from_rows``: the
quantized kernel below it, the dense weight from it up (1: dense always, so the layer is not kept quantized; None:
quantized always, no dense copy). On a host with AMX an int4 / int8 shape is first timed on the C kernel's AMX
build against its integer one, giving ``amx_from_rows`` (the AMX build from there; 0: never), and the dense layout
then meets the kernel that way. The thresholds are kept on disk per CPU model with the others, keyed by the C
kernels' source so that a changed kernel is measured again.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch
import torch.nn.functional as F

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.layouts import (MAX_DUAL_SHARE, RULE, Layouts, MeasuredThresholds, Shape,
                                      _itemsize, available_memory, cheapest_threshold, cold_copies, ratios_by_rows)
from tokenmill.engine.probe import Clock
from tokenmill.kernels.cpu_linear import pack_weight, packed_linear
from tokenmill.kernels.cpu_native import amx_available, source_digest
from tokenmill.kernels.quant_linear import CPUQuantMatmul, WeightFormat, quantize
from tokenmill.models.base import DecoderLM
from tokenmill.models.config import ModelConfig
from tokenmill.models.quant_methods import CHECKPOINT_METHODS
from tokenmill.models.quantization import candidate_formats, check_supported

log = logging.getLogger(__name__)

# ((out, in, format name, dense_from_rows, amx_from_rows), ...): the settled table of quantized candidates.
# The row counts timed: fine where the quantized kernel's time (it grows with the rows) crosses the dense GEMM's.
# The row-at-a-time kernel crosses between 4 and 16 rows (at 12-14 rows, on thresholds probed only at 4 and 16, it
# ran 1.1-1.4x slower than dense: an AVX-512 Xeon, SmolLM2's shapes); the interleaved kernel between 16 and 64
# (benchmarks/results/quant-kernel-vnni.json: against dense bf16 the 3072x576 layer crosses near 32 rows).
QUANT_PROBE_ROWS = (1, 2, 4, 6, 8, 10, 12, 14, 16, 24, 32, 48, 64, 256)
# Where the machine is too noisy to tell: the quantized kernels read fewer bytes, which pays while a call is
# memory-bound (small batches).
FALLBACK_DENSE_FROM_ROWS = 16
QuantLayouts = tuple[tuple[int, int, str, "int | None", int], ...]


def choose_quantization(config: EngineConfig, model_config: ModelConfig, meta: DecoderLM, device: str, size: int,
                        layouts: Layouts, dtype: torch.dtype, threads: int, clock: Clock) -> QuantLayouts:
    """The quantized candidates' table: measured on a CPU for a checkpoint's own formats (``auto``), quantized always
    for ``checkpoint`` and ``int8|int4|fp8``, dense for a checkpoint's own formats under ``auto`` on a GPU (no GPU
    kernel reads them yet) or across tensor-parallel ranks."""
    mode = config.quantization
    try:
        check_supported(meta, model_config, mode)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    shipped = model_config.quantization.method if model_config.quantization else None
    if shipped in CHECKPOINT_METHODS:  # no full-precision copy to fall back on
        if mode not in ("auto", "checkpoint"):
            raise ConfigError(f"this checkpoint's weights are stored quantized ({shipped}): --quantization {mode} "
                              f"cannot serve them otherwise (use auto)")
        if not hasattr(meta, "linear_sources"):
            raise ConfigError(f"{shipped} checkpoints are not built for {model_config.architecture} yet")
        if size > 1:
            raise ConfigError(f"{shipped} checkpoints are not built for tensor-parallel ranks yet")
        mode = "checkpoint"
    candidates: dict[tuple[int, int, str], int] = {}
    at_load = False
    for path, (fmt, at_load) in candidate_formats(meta, model_config, mode, config.quantization_group_size).items():
        layer = meta.get_submodule(path)
        key = (layer.out_features, layer.in_features, fmt)
        candidates[key] = candidates.get(key, 0) + 1
    if not candidates:
        return ()
    if size > 1:
        if at_load or mode == "checkpoint":
            raise ConfigError(f"--quantization {mode} is not built for tensor-parallel ranks yet")
        return tuple((out, inp, fmt, 1, 0) for out, inp, fmt in sorted(candidates))
    if at_load or mode == "checkpoint":
        return tuple((out, inp, fmt, None, 0) for out, inp, fmt in sorted(candidates))
    if device != "cpu":  # a GPU, or the PyTorch references ("torch"): no kernel reads them faster than dense
        return tuple((out, inp, fmt, 1, 0) for out, inp, fmt in sorted(candidates))
    table = choose_quant_layouts(candidates, {(o, i): t for o, i, t in layouts}, dtype, threads, clock,
                                 config.kernel_cache_dir)
    log.info("quantized weights (%s): %s", mode, describe_quant(table))
    return table


def choose_quant_layouts(candidates: dict[tuple[int, int, str], int], dense: dict[Shape, int | None],
                         dtype: torch.dtype, threads: int, clock: Clock = time.perf_counter,
                         cache_dir: str | None = None) -> QuantLayouts:
    """``candidates``: {(out, in, format): how many layers} -> each one's ``amx_from_rows`` (where the host has the
    AMX kernel) and ``dense_from_rows`` against its dense layout (``dense``: the shape's packed_from_rows). Where
    both copies of the layers that need both would not fit in MAX_DUAL_SHARE of the memory available, those keep
    only the quantized weight."""
    table = {}
    cache = MeasuredThresholds(cache_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for (out, inp, fmt), count in sorted(candidates.items()):
            packed_from = dense.get((out, inp))
            key = f"{out}x{inp}:{fmt}:{dtype}:{threads} threads:{cold_copies(out, inp, count, dtype)} copies:" \
                  f"dense packed from {packed_from}:rows {QUANT_PROBE_ROWS}:kernels {source_digest()}:{RULE}"
            amx_from = 0
            if amx_available() and WeightFormat.parse(fmt).kind != "fp8":
                if f"{key}:amx" not in cache.thresholds:
                    cache.thresholds[f"{key}:amx"] = amx_from_rows(out, inp, count, fmt, dtype, clock)
                    cache.dirty = True
                amx_from = cache.thresholds[f"{key}:amx"]
                key = f"{key}:amx from {amx_from}"
            if key not in cache.thresholds:
                cache.thresholds[key] = dense_from_rows(out, inp, count, fmt, dtype, packed_from, clock, amx_from)
                cache.dirty = True
            table[(out, inp, fmt)] = (cache.thresholds[key], amx_from)
    finally:
        torch.set_num_threads(before)
    cache.save()
    dual = sum(out * inp * candidates[(out, inp, fmt)] * _itemsize(dtype)
               for (out, inp, fmt), (t, _) in table.items() if t is not None and t > 1)
    if dual > MAX_DUAL_SHARE * available_memory():
        log.info("quantized layers: their dense copies would take %.1f GiB: quantized only", dual / 2**30)
        table = {key: (t if t == 1 else None, amx) for key, (t, amx) in table.items()}
    return tuple((out, inp, fmt, t, amx) for (out, inp, fmt), (t, amx) in sorted(table.items()))


@functools.lru_cache(maxsize=None)
def amx_from_rows(out: int, inp: int, count: int, fmt: str, dtype: torch.dtype, clock: Clock = time.perf_counter
                  ) -> int:
    """The row count from which the C kernel's AMX build serves instead of its integer one (0: never):
    cheapest_threshold of the probed AMX / integer times. Noise keeps the integer build (the one measured longest)."""
    weight_format = WeightFormat.parse(fmt)
    copies = cold_copies(out, inp, count, dtype)
    with torch.inference_mode():
        tensors = [quantize(torch.randn(out, inp) / math.sqrt(inp), weight_format) for _ in range(copies)]
        kernels = {amx: [CPUQuantMatmul(weight_format, q["qweight"], q["scales"], q.get("mins"), amx_from_rows=amx)
                         for q in tensors] for amx in (0, 1)}
        ratios = ratios_by_rows(lambda x, n: ((lambda: [kernel(x) for kernel in kernels[0][:n]]),
                                              (lambda: [kernel(x) for kernel in kernels[1][:n]])),
                                inp, dtype, copies, clock, QUANT_PROBE_ROWS)
    threshold = cheapest_threshold(ratios, QUANT_PROBE_ROWS[-1] + 1, QUANT_PROBE_ROWS)
    log.debug("linear %dx%d %s: AMX / integer kernel time by rows %s -> %s", out, inp, fmt,
              dict(zip(QUANT_PROBE_ROWS, ratios)), threshold)
    return threshold or 0


def dense_from_rows(out: int, inp: int, count: int, fmt: str, dtype: torch.dtype, packed_from: int | None,
                    clock: Clock = time.perf_counter, amx_from: int = 0) -> int | None:
    """The row count from which the dense layout (packed from ``packed_from`` rows, plain below) serves instead of
    the quantized kernel (its AMX build from ``amx_from`` rows): cheapest_threshold of the probed dense / quantized
    times (None: quantized always)."""
    ratios = dense_over_quantized(out, inp, count, fmt, dtype, packed_from, clock, amx_from)
    threshold = cheapest_threshold(ratios, FALLBACK_DENSE_FROM_ROWS, QUANT_PROBE_ROWS)
    log.debug("linear %dx%d %s: dense / quantized time by rows %s -> %s", out, inp, fmt,
              dict(zip(QUANT_PROBE_ROWS, ratios)), threshold)
    return threshold


def dense_over_quantized(out: int, inp: int, count: int, fmt: str, dtype: torch.dtype, packed_from: int | None,
                         clock: Clock = time.perf_counter, amx_from: int = 0) -> list[float | None]:
    """The dense layout's time over the quantized kernel's at each of QUANT_PROBE_ROWS (None: too noisy), on random
    weights of the shape, walking as many cold copies as the model has layers of it (up to COLD_BYTES)."""
    copies = cold_copies(out, inp, count, dtype)
    weight_format = WeightFormat.parse(fmt)
    with torch.inference_mode():
        weights = [torch.randn(out, inp, dtype=dtype) / math.sqrt(inp) for _ in range(copies)]
        packed = [pack_weight(w) if packed_from is not None else None for w in weights]
        quantized = [CPUQuantMatmul(weight_format, q["qweight"], q["scales"], q.get("mins"), amx_from_rows=amx_from)
                     for q in (quantize(w, weight_format) for w in weights)]
        def dense(x: torch.Tensor, n: int) -> list[torch.Tensor]:
            use_packed = packed_from is not None and x.shape[0] >= packed_from
            return [packed_linear(x, p, None) if use_packed else F.linear(x, w) for w, p in zip(weights[:n], packed)]
        return ratios_by_rows(lambda x, n: ((lambda: [kernel(x) for kernel in quantized[:n]]),
                                            (lambda: dense(x, n))), inp, dtype, copies, clock, QUANT_PROBE_ROWS)


def describe_quant(layouts: QuantLayouts) -> str:
    return ", ".join(f"{out}x{inp} {fmt}: " + ("dense" if t == 1 else "quantized" if t is None else
                                               f"quantized below {t} rows, dense from {t}")
                     + (f" (AMX from {amx} rows)" if amx and t != 1 else "")
                     for out, inp, fmt, t, amx in layouts) or "none"
