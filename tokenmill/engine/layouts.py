"""The CPU weight layout of each linear layer shape, settled at start-up (kernels/cpu_linear.py runs it).

For every distinct [out, in] shape of the model's linear layers, a plain weight (``F.linear``) is timed against the
same weight packed for oneDNN (fastest of interleaved samples: ``fastest_ratio``), over the row counts the scheduler
produces (a lone decode up to a prefill chunk). The result is a threshold: packed from ``packed_from_rows`` rows
up, plain below, or never packed (None). Timings walk through as many distinct copies of the weight as the model
has layers of that shape (up to COLD_BYTES), so a memory-bound call reads from memory, not from a cache that a
real step would have evicted.

Measured thresholds are kept on disk per CPU model (``cache_dir``: kernel_cache_dir), so a restart on the same
host does not measure again (a few seconds); delete the file to measure afresh.

Quantized weights join the table the same way (engine/quant_layouts.py).

A layer whose threshold is above one row keeps both layouts (the plain one for small calls): that costs one more
copy of its weights, allowed while both copies of every such layer fit in MAX_DUAL_SHARE of the memory available;
past that, every layer is packed from one row (one copy).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.engine.probe import Clock, Work
from tokenmill.kernels.cpu_linear import pack_weight, packed_linear
from tokenmill.kernels.cpu_native import cpu_identity

log = logging.getLogger(__name__)

# Rows timed: one decode, small and busy decode batches, a prefill chunk.
LAYOUT_PROBE_ROWS = (1, 2, 4, 16, 64, 256)
# Where the machine is too noisy to tell at some row count: oneDNN's packed kernels win from a few rows up on AVX2,
# AVX-512 and AMX alike (benchmarks/cpu_gemm.py; vLLM packs every CPU linear layer).
FALLBACK_PACKED_FROM_ROWS = 4
# Bytes of weight copies a memory-bound timing walks through (beyond any CPU's last-level cache).
COLD_BYTES = 96 * 2**20
# Row counts up to this walk cold weight copies; above, one copy is enough (compute-bound). A decode batch of up to
# 64 rows still reads its weights from memory in a real step: probed on one warm copy at 24-48 rows the dense GEMM
# took 0.63-1.02x the int4 kernel's time, on cold copies 1.02-1.23x (Zen 4, SmolLM2's shapes, an hour apart:
# benchmarks/results/layout-probe-zen4.json, -cold64.json).
COLD_ROWS_MAX = 64
# How a threshold is chosen from the probed times (cheapest_threshold), part of every kept threshold's key: a
# threshold settled by an earlier rule is measured again.
RULE = "cheapest, cold to 64 rows"
# What a row count too noisy to measure adds for or against a threshold, in relative time (a tie-break, no more).
UNMEASURED_VOTE = 1e-3
# Interleaved samples of each layout per (shape, rows), and the seconds they may take.
LAYOUT_SAMPLES = 9
LAYOUT_BUDGET_S = 0.4
MAX_DUAL_SHARE = 0.25

Shape = tuple[int, int]  # (out_features, in_features)
Layouts = tuple[tuple[int, int, "int | None"], ...]  # ((out, in, packed_from_rows), ...): the settled table


def linear_shapes(model: torch.nn.Module) -> dict[Shape, int]:
    """The model's packable linear layers (a model built on the meta device will do): {(out, in): how many}."""
    skip = getattr(model, "unpacked_linears", ())
    shapes: dict[Shape, int] = {}
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is torch.nn.Linear and name not in skip:
                key = (child.out_features, child.in_features)
                shapes[key] = shapes.get(key, 0) + 1
    return shapes


def choose_layouts(mode: str, shapes: dict[Shape, int], dtype: torch.dtype, threads: int,
                   clock: Clock = time.perf_counter, cache_dir: str | None = None) -> Layouts:
    """The settled table for ``mode`` ("plain" | "packed" | "auto"); ``cache_dir``: where measured thresholds are
    kept across restarts (None: measure every time)."""
    if mode == "plain" or not shapes:
        return ()
    if pack_weight(torch.zeros(8, 8, dtype=dtype)) is None:
        log.info("linear layers: plain weights (oneDNN cannot pack %s on this CPU)", dtype)
        return ()
    if mode == "packed":
        return tuple((out, inp, 1) for out, inp in sorted(shapes))
    table = {}
    cache = MeasuredThresholds(cache_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for (out, inp), count in sorted(shapes.items()):
            key = f"{out}x{inp}:{dtype}:{threads} threads:{cold_copies(out, inp, count, dtype)} copies:{RULE}"
            if key not in cache.thresholds:
                cache.thresholds[key] = packed_from_rows(out, inp, count, dtype, threads, clock)
                cache.dirty = True
            table[(out, inp)] = cache.thresholds[key]
    finally:
        torch.set_num_threads(before)
    cache.save()
    dual = sum(2 * out * inp * shapes[(out, inp)] * _itemsize(dtype) for (out, inp), t in table.items()
               if t is not None and t > 1)
    if dual > MAX_DUAL_SHARE * available_memory():
        log.info("linear layers: both layouts would take %.1f GiB: packed from one row instead", dual / 2**30)
        table = {shape: 1 if t is not None else None for shape, t in table.items()}
    return tuple((out, inp, t) for (out, inp), t in sorted(table.items()))


def describe(layouts: Layouts) -> str:
    return ", ".join(f"{out}x{inp}: " + ("plain" if t is None else f"packed from {t} rows" if t > 1 else "packed")
                     for out, inp, t in layouts) or "all plain"


@functools.lru_cache(maxsize=None)  # engines of one process (tests) share what a shape measured
def packed_from_rows(out: int, inp: int, count: int, dtype: torch.dtype, threads: int,
                     clock: Clock = time.perf_counter) -> int | None:
    """The row count from which the packed weight serves (cheapest_threshold of the probed packed / plain times)."""
    copies = cold_copies(out, inp, count, dtype)
    with torch.inference_mode():
        weights = [torch.randn(out, inp, dtype=dtype) / math.sqrt(inp) for _ in range(copies)]
        packed = [pack_weight(w) for w in weights]
        ratios = ratios_by_rows(lambda x, n: ((lambda: [F.linear(x, w) for w in weights[:n]]),
                                              (lambda: [packed_linear(x, p, None) for p in packed[:n]])),
                                inp, dtype, copies, clock)
    threshold = cheapest_threshold(ratios, FALLBACK_PACKED_FROM_ROWS)
    log.debug("linear %dx%d (%s): packed / plain time by rows %s -> %s", out, inp, dtype,
              dict(zip(LAYOUT_PROBE_ROWS, ratios)), threshold)
    return threshold


def cheapest_threshold(ratios: list[float | None], fallback_from: int,
                       probe_rows: tuple[int, ...] = LAYOUT_PROBE_ROWS) -> int | None:
    """The threshold ``t`` (layout b from ``t`` rows up, a below; None: a always) that minimizes the summed relative
    time over ``probe_rows``: the sum over counts r >= t of (ratio_r - 1), ratio_r = b's time / a's. A near-tie that
    noise tips the wrong way then costs little and moves nothing far (the earlier rule, b from the smallest count
    after which it never lost, moved a layer's threshold from 12-14 rows to 64 on one 1.00-1.02 tie at 48, over
    counts where b was 1.5x faster). A count too noisy to measure (None) votes for ``fallback_from`` by
    UNMEASURED_VOTE. On a tie the larger threshold stays (a, the layout the layer starts from, unless b is worth
    more)."""
    best, best_cost, cost = None, 0.0, 0.0
    for rows, ratio in zip(reversed(probe_rows), reversed(ratios)):
        if ratio is None:
            cost += -UNMEASURED_VOTE if rows >= fallback_from else UNMEASURED_VOTE
        else:
            cost += ratio - 1.0
        if cost < best_cost - 1e-9:
            best, best_cost = rows, cost
    return best


def ratios_by_rows(pair, inp: int, dtype: torch.dtype, copies: int, clock: Clock,
                   probe_rows: tuple[int, ...] = LAYOUT_PROBE_ROWS) -> list[float | None]:
    """For each of ``probe_rows``, ``b``'s time over ``a``'s for ``(a, b) = pair(x, n)`` (x: that many random rows;
    n: the weight copies to walk, all of them while memory-bound); None where the machine is too noisy to tell."""
    ratios = []
    for rows in probe_rows:
        a, b = pair(torch.randn(rows, inp, dtype=dtype), copies if rows <= COLD_ROWS_MAX else 1)
        a(), b()  # warm-up: first calls pick kernels, fault pages in
        ratios.append(fastest_ratio(a, b, clock))
    return ratios


def fastest_ratio(a: Work, b: Work, clock: Clock = time.perf_counter, samples: int = LAYOUT_SAMPLES,
                  budget_s: float = LAYOUT_BUDGET_S) -> float | None:
    """Fastest time of ``b`` over fastest time of ``a``, the two timed alternately ``samples`` times each (fewer
    where the budget runs out; None before two of each). A busy neighbour only ever adds time, so the fastest of
    several interleaved samples is what each costs on a quiet machine; a ratio of sums would carry the noise."""
    start = clock()
    best_a = best_b = math.inf
    for i in range(samples):
        for work, first in ((a, True), (b, False)) if i % 2 == 0 else ((b, False), (a, True)):
            t0 = clock()
            work()
            elapsed = clock() - t0
            if first:
                best_a = min(best_a, elapsed)
            else:
                best_b = min(best_b, elapsed)
        if clock() - start > budget_s and i >= 1:
            break
    if not (math.isfinite(best_a) and math.isfinite(best_b)) or best_a <= 0:
        return None
    return best_b / best_a


def cold_copies(out: int, inp: int, count: int, dtype: torch.dtype) -> int:
    return max(1, min(count, math.ceil(COLD_BYTES / (out * inp * _itemsize(dtype)))))


class MeasuredThresholds:
    """Thresholds measured on this CPU model, read from and written back to one JSON file in ``cache_dir``."""

    def __init__(self, cache_dir: str | None):
        self.path = None
        self.thresholds: dict[str, int | None] = {}
        self.dirty = False
        if cache_dir is None:
            return
        cpu = hashlib.sha256(cpu_identity().encode()).hexdigest()[:16]
        self.path = Path(cache_dir).expanduser() / f"cpu-linear-layouts-{cpu}.json"
        try:
            self.thresholds = json.loads(self.path.read_text())
            log.info("linear layouts: thresholds measured earlier on this CPU from %s", self.path)
        except (OSError, ValueError):
            self.thresholds = {}

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.thresholds, indent=1, sort_keys=True))
            os.replace(tmp, self.path)  # atomic: a concurrent start reads a whole file or none
        except OSError as exc:
            log.warning("linear layouts: cannot keep the thresholds in %s (%s)", self.path, exc)


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62  # unknown: no cap


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
