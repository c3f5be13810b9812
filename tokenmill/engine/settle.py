"""Every choice the configuration leaves open, settled once, before the model is built: ``settle(config,
model_config) -> Settled``. Nothing downstream decides again: the builder, the runner and the worker ranks (which
receive rank 0's ``Settled``) read it.

What is settled, and how ``auto`` resolves:
- device: CUDA when torch sees one, else the CPU;
- KV cache dtype: fp8 on CUDA (native fp8 reads in the Triton kernels), bf16 on a CPU (no vector fp8 conversion);
- kernel backend: Triton on CUDA, the C kernels on a CPU where they build, else the PyTorch references
  (kernels/backend.py);
- compute dtype: bfloat16 on CUDA; on a CPU the faster of bfloat16 and float32 for the model's linear layers,
  measured here (engine/probe.py: interleaved rounds until two agree), or the hardware's known answer when the
  machine is too noisy to tell: bfloat16 with AMX or AVX-512-BF16, float32 without;
- threads: on a CPU every core, or one fewer (left to the API process) where a proxy of the model's decode step
  (one synthetic layer of its shapes) runs as fast on them; every core when too noisy to tell; under tensor
  parallelism the cores shared out among the ranks;
- CPU weight layouts: per linear layer shape, the row count from which a weight packed for oneDNN beats the plain
  one, measured here (engine/layouts.py); the layers pack at load (kernels/cpu_linear.py);
- quantized weights (models/quantization.py): the candidates of ``--quantization``; a checkpoint's own quantized
  tensors (``auto``) are timed per shape and format against the dense layout on a CPU (engine/layouts.py) and kept
  quantized below the row count where dense wins (dense on a GPU until a GPU kernel reads them); ``int8|int4|fp8``
  are quantized at every row count;
- CPU decode attention's prefetch target: the next cache block asked into the L1 or only the L2, whichever the
  kernel ran faster at the model's head layout, timed here (engine/attention_prefetch.py);
- CPU prefill attention: PyTorch's flash SDPA over a chunk's own tokens, the tile kernel (on AMX or AVX512-BF16
  registers), or the paged decode kernel with causal segments, whichever ran fastest at the model's head layout
  (engine/prefill_attention.py);
- execution: captured CUDA graphs (one GPU, Triton kernels), a compiled layer stack on a CPU, or eager;
- drafting: the speculative method, checked against the checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.distributed.group import TensorParallel
from tokenmill.engine.attention_prefetch import choose_attention_prefetch
from tokenmill.engine.layouts import Layouts, choose_layouts, describe, linear_shapes
from tokenmill.engine.prefill_attention import choose_prefill_attention
from tokenmill.engine.quant_layouts import QuantLayouts, choose_quantization
from tokenmill.engine.probe import Clock, Comparison, compare, repetitions
from tokenmill.kernels.backend import resolve_kernel_backend
from tokenmill.kernels.cpu_linear import pack_weight, packed_linear
from tokenmill.models.base import DecoderLM
from tokenmill.models.config import ModelConfig, tp_split
from tokenmill.models.registry import model_class_for

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Execution = Literal["eager", "compiled", "cuda_graphs"]

# Rows of the linear layers the dtype is timed on: a lone decode, a busy decode step, a prefill chunk.
DTYPE_PROBE_ROWS = (1, 16, 256)
# Decode batches the thread layout is timed on: a lone request and a busy step.
THREAD_PROBE_BATCHES = (1, 16)
# Leave a core to the API process only where the engine loses nothing by it (time with one core fewer over time
# with every core, geometric mean over the probe batches). A 1.25 threshold was tried and measured: on a 2-core EPYC
# it kept 1 thread (ratios 0.94 at batch 1, 1.25 at 16), which gained 1.41x output tokens/s at concurrency 1 but lost
# 0.71x at 16 (benchmarks/results/compare-cpu-compiled).
ALL_CORES_MIN_SPEEDUP = 1.0
# Seconds each start-up measurement may take before the hardware's known answer is used instead.
PROBE_BUDGET_S = 3.0
# The proxy's matrices are capped at this width: the choice depends on the CPU's kernels, not on a model's size.
PROXY_MAX_WIDTH = 4096


@dataclass(frozen=True)
class Settled:
    device: str  # "cpu" | "cuda" (a rank's device index comes from its rank)
    dtype: str  # compute dtype: "float32" | "bfloat16" | "float16"
    num_threads: int | None  # torch CPU threads of each rank; None on CUDA (torch's default)
    kv_cache_dtype: str  # "fp8" | "bf16" | "fp16" | "fp32"
    kernel_backend: str  # "triton" | "cpu" | "torch"
    execution: Execution
    speculative_method: str  # "off" | "ngram" | "mtp"
    tensor_parallel_size: int
    # CPU linear layers: ((out, in, packed_from_rows | None), ...) per shape (engine/layouts.py); () = all plain.
    linear_layouts: Layouts = ()
    # Quantized candidates: ((out, in, format, dense_from_rows | None, amx_from_rows), ...) (engine/quant_layouts.py);
    # () = none.
    quant_layouts: QuantLayouts = ()
    # CPU decode attention's prefetch target (engine/attention_prefetch.py): "l1" | "l2".
    attention_prefetch: str = "l1"
    # CPU prefill attention (engine/prefill_attention.py): "sdpa" | "amx" | "avx512" | "paged".
    prefill_attention: str = "sdpa"

    def __post_init__(self):  # a broadcast copy may arrive with lists for tuples
        object.__setattr__(self, "linear_layouts", tuple(tuple(row) for row in self.linear_layouts))
        object.__setattr__(self, "quant_layouts", tuple(tuple(row) for row in self.quant_layouts))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def settle(config: EngineConfig, model_config: ModelConfig, clock: Clock = time.perf_counter) -> Settled:
    """Resolve every ``auto`` and check the choices against the checkpoint (ConfigError saying why not)."""
    size = config.launch_tensor_parallel_size
    if size > 1:
        check_split(model_config, size)
    if config.speculative_method == "mtp" and not model_config.num_mtp_layers:
        raise ConfigError("--speculative-method mtp needs a checkpoint with a multi-token-prediction layer "
                          "(DeepSeek-V3's num_nextn_predict_layers); this one has none")
    device = choose_device(config)
    kv_dtype = choose_kv_cache_dtype(config, device)
    try:
        backend = resolve_kernel_backend(config.kernel_backend, torch.device(device),
                                         fp8=model_config.fp8_weight_block is not None or kv_dtype == "fp8")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    shapes = proxy_shapes(model_config)
    dtype = choose_dtype(config, device, shapes, clock)
    threads = choose_threads(config, device, size, model_config, dtype, clock)
    layouts: Layouts = ()
    meta = meta_model(config, model_config, size)
    if device == "cpu":
        layouts = choose_layouts(config.cpu_weight_layout, linear_shapes(meta), DTYPES[dtype],
                                 threads or torch.get_num_threads(), clock, config.kernel_cache_dir)
        log.info("linear layers (%s): %s", config.cpu_weight_layout, describe(layouts))
    quant_layouts = choose_quantization(config, model_config, meta, device if backend != "torch" else "torch",
                                        size, layouts, DTYPES[dtype], threads or torch.get_num_threads(), clock)
    settled = Settled(
        device=device, dtype=dtype, num_threads=threads, kv_cache_dtype=kv_dtype, kernel_backend=backend,
        execution=choose_execution(config, device, backend, size, model_config),
        speculative_method=config.speculative_method, tensor_parallel_size=size, linear_layouts=layouts,
        quant_layouts=quant_layouts, attention_prefetch=choose_attention_prefetch(
            config.attention_prefetch, device, backend, model_config.num_heads // size,
            0 if model_config.mla else model_config.num_kv_heads // size, model_config.head_dim, config.block_size,
            kv_dtype, DTYPES[dtype], threads or torch.get_num_threads(), clock),
        prefill_attention=choose_prefill_attention(
            config.prefill_attention, device, backend, model_config.num_heads // size,
            0 if model_config.mla else model_config.num_kv_heads // size, model_config.head_dim, DTYPES[dtype],
            threads or torch.get_num_threads(), clock, kv_dtype=kv_dtype, block_size=config.block_size))
    log.info("settled: %s", ", ".join(f"{k}={v}" for k, v in settled.to_dict().items()))
    return settled


def meta_model(config: EngineConfig, model_config: ModelConfig, size: int) -> DecoderLM:
    """Rank 0's model on the meta device (no memory): what its layers' shapes are."""
    extra: dict[str, Any] = {"mtp": True} if config.speculative_method == "mtp" else {}
    if size > 1:
        extra["tp"] = TensorParallel(0, size)
    with torch.device("meta"):
        return model_class_for(model_config)(model_config, **extra)


def choose_device(config: EngineConfig) -> str:
    return config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"


def choose_kv_cache_dtype(config: EngineConfig, device: str) -> str:
    """fp8 on CUDA (the Triton kernels read it natively); bf16 on a CPU, which has no vector fp8 conversion (widening
    an fp8 cache cost more than its halved reads)."""
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    return "fp8" if device == "cuda" else "bf16"


def check_split(model_config: ModelConfig, size: int) -> None:
    """The model must split over ``size`` ranks: a ConfigError says why not."""
    if model_class_for(model_config).weight_shard is DecoderLM.weight_shard:
        raise ConfigError(f"tensor parallelism is not built for {model_config.architecture} yet")
    try:
        tp_split(model_config.num_heads, size, "the attention heads")
        tp_split(model_config.intermediate_size, size, "the MLP width")
        model_config.local_kv_heads(size)
        if model_config.moe:
            tp_split(model_config.moe.num_experts, size, "the routed experts")
            tp_split(model_config.moe.intermediate_size * model_config.moe.num_shared_experts, size,
                     "the shared experts' width")
    except ValueError as exc:
        raise ConfigError(f"--tensor-parallel-size {size}: {exc}") from None


def choose_execution(config: EngineConfig, device: str, backend: str, size: int,
                     model_config: ModelConfig) -> Execution:
    """CUDA graphs on one GPU with the Triton kernels (the PyTorch references sync the host); the compiled layer
    stack on a CPU for models that compile (tensor-parallel ranks run eagerly); eager otherwise, with the reason in
    the log. A compile that fails all the same falls back to eager at build (engine/warmup.py)."""
    if config.enforce_eager or size > 1:
        return "eager"
    if device == "cuda":  # DSA's selection reads the step's positions on the host (kernels/dsa.py): no graphs yet
        return "cuda_graphs" if backend == "triton" and model_config.dsa is None else "eager"
    blocker = model_class_for(model_config).compile_blocker(model_config)
    if blocker is not None:
        log.info("execution: eager, since %s does not compile (%s)", model_config.architecture, blocker)
        return "eager"
    return "compiled"


# --- the hardware's known answers

def hardware_prefers_bf16() -> bool:
    """CPUs with AMX or AVX-512-BF16 multiply bfloat16 natively; others (AVX2) emulate it, several times slower."""
    try:
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except AttributeError:  # an older torch: read the CPU flags
        try:
            with open("/proc/cpuinfo") as fh:
                flags = fh.read()
        except OSError:
            return False
        return "amx_bf16" in flags or "avx512_bf16" in flags


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --- the compute dtype

def proxy_shapes(model_config: ModelConfig) -> dict[str, int]:
    """The widths of one decoder layer of the model, capped at PROXY_MAX_WIDTH (the KV heads divide the heads)."""
    cap = lambda n: max(1, min(n, PROXY_MAX_WIDTH))  # noqa: E731
    inter = model_config.moe.intermediate_size if model_config.moe else model_config.intermediate_size
    d = model_config.head_dim
    heads = max(1, min(model_config.num_heads, PROXY_MAX_WIDTH // d))
    kv = min(model_config.num_kv_heads, heads)
    return {"hidden": cap(model_config.hidden_size), "intermediate": cap(inter), "heads": heads,
            "kv_heads": kv if heads % kv == 0 else 1, "head_dim": d}


def choose_dtype(config: EngineConfig, device: str, shapes: dict[str, int], clock: Clock = time.perf_counter) -> str:
    if config.dtype != "auto":
        return config.dtype
    if device == "cuda":
        return "bfloat16"
    comparison = time_bf16_over_fp32(shapes["intermediate"], shapes["hidden"], clock=clock)
    if comparison.ratio is None:
        dtype = "bfloat16" if hardware_prefers_bf16() else "float32"
        log.warning("dtype auto -> %s: the hardware's answer (%s), since the machine is too noisy to tell "
                    "(bfloat16 / float32 time of a %dx%d linear layer, M=%s: %s)", dtype,
                    "AMX or AVX-512-BF16" if dtype == "bfloat16" else "no AMX, no AVX-512-BF16",
                    shapes["intermediate"], shapes["hidden"], DTYPE_PROBE_ROWS, comparison.describe())
        return dtype
    dtype = "bfloat16" if comparison.ratio < 1.0 else "float32"
    log.info("dtype auto -> %s (bfloat16 / float32 time of a %dx%d linear layer, M=%s: %s)", dtype,
             shapes["intermediate"], shapes["hidden"], DTYPE_PROBE_ROWS, comparison.describe())
    return dtype


@torch.inference_mode()
def time_bf16_over_fp32(out_features: int, in_features: int, rows: tuple[int, ...] = DTYPE_PROBE_ROWS,
                        clock: Clock = time.perf_counter, budget_s: float = PROBE_BUDGET_S) -> Comparison:
    """A linear layer in float32 (A) against bfloat16 (B), one case per batch of ``rows`` rows, each as the engine
    would run it: packed for oneDNN from two rows up where this CPU packs the dtype (kernels/cpu_linear.py), plain
    otherwise (an AMX host's bfloat16 is slow plain, re-blocked on every call, and fast packed)."""
    cases, reps = [], []
    for m in rows:
        pair = []
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, in_features, dtype=dtype), torch.randn(out_features, in_features, dtype=dtype)
            packed = pack_weight(w) if m > 1 else None
            work = (lambda x=x, w=w: torch.nn.functional.linear(x, w)) if packed is None else \
                (lambda x=x, packed=packed: packed_linear(x, packed, None))
            work()  # warm-up: first calls pick kernels, fault pages in
            pair.append(work)
        cases.append(tuple(pair))
        reps.append(repetitions(pair[0], clock))
    return compare(cases, clock=clock, budget_s=budget_s, reps=reps)


# --- the thread count

def choose_threads(config: EngineConfig, device: str, size: int, model_config: ModelConfig, dtype: str,
                   clock: Clock = time.perf_counter) -> int | None:
    if config.num_threads:
        return config.num_threads
    if device == "cuda":
        return None
    cores = available_cores()
    if size > 1:
        return max(1, cores // size)
    if cores < 2:
        return max(cores, 1)
    comparison = time_fewer_over_all_threads(proxy_shapes(model_config), DTYPES[dtype], cores, clock=clock)
    if comparison.ratio is None:
        log.warning("engine threads: %d of %d cores, since the machine is too noisy to tell (decode proxy with %d "
                    "threads / with %d, batches %s: %s)", cores, cores, cores - 1, cores, THREAD_PROBE_BATCHES,
                    comparison.describe())
        return cores
    chosen = cores if comparison.ratio > ALL_CORES_MIN_SPEEDUP else cores - 1
    log.info("engine threads: %d of %d cores (decode proxy with %d threads / with %d, batches %s: %s)", chosen,
             cores, cores - 1, cores, THREAD_PROBE_BATCHES, comparison.describe())
    return chosen


@torch.inference_mode()
def time_fewer_over_all_threads(shapes: dict[str, int], dtype: torch.dtype, cores: int,
                                clock: Clock = time.perf_counter, budget_s: float = PROBE_BUDGET_S) -> Comparison:
    """A decode-step proxy run with every core (A) against one core fewer (B), per batch of THREAD_PROBE_BATCHES;
    the thread count is restored afterwards."""
    before = torch.get_num_threads()
    try:
        cases = []
        for batch in THREAD_PROBE_BATCHES:
            layer = decode_layer_proxy(shapes, dtype, batch)
            torch.set_num_threads(cores)
            layer()  # warm-up
            reps = repetitions(layer, clock)

            def run(threads: int, layer=layer, reps=reps) -> None:
                torch.set_num_threads(threads)
                for _ in range(reps):
                    layer()
            cases.append((lambda run=run: run(cores), lambda run=run: run(cores - 1)))
        # the fastest times: a neighbour at start-up (the API process importing, a server still shutting down) slows
        # the every-core run far more than the other; compared round by round, that kept a 2-core Zen 4 at 1 thread
        # (rounds 2.08, 0.83, 0.91: BENCHMARKS.md, issue 24, 2026-12-06)
        return compare(cases, clock=clock, budget_s=budget_s, estimate="best")
    finally:
        torch.set_num_threads(before)


def decode_layer_proxy(shapes: dict[str, int], dtype: torch.dtype, batch: int, context: int = 256):
    """One synthetic decoder layer of the model's widths (norms, projections, attention over ``context`` cached
    tokens, gated MLP) decoding ``batch`` tokens: the op mix whose threading the decode step depends on (its
    linear layers packed from two rows up, as kernels/cpu_linear.py runs them on most hosts)."""
    h, inter, heads, kv, d = (shapes[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"))
    def w(rows: int, cols: int):  # a linear layer as the engine runs it: packed where oneDNN packs this dtype
        weight = torch.randn(rows, cols, dtype=dtype) / math.sqrt(cols)
        packed = pack_weight(weight) if batch > 1 else None
        return (lambda t: packed_linear(t, packed, None)) if packed is not None else \
            (lambda t: torch.nn.functional.linear(t, weight))
    qkv, o, gate_up, down = w((heads + 2 * kv) * d, h), w(h, heads * d), w(2 * inter, h), w(h, inter)
    x = torch.randn(batch, h, dtype=dtype)
    k_cache = torch.randn(batch, kv, context, d, dtype=dtype)
    v_cache = torch.randn(batch, kv, context, d, dtype=dtype)
    norm = lambda t: t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(dtype)  # noqa: E731

    def layer() -> torch.Tensor:
        q = qkv(norm(x))[:, :heads * d].reshape(batch, heads, 1, d)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=heads != kv)
        y = x + o(attn.reshape(batch, heads * d))
        gate, up = gate_up(norm(y)).chunk(2, dim=-1)
        return y + down(torch.nn.functional.silu(gate) * up)
    return layer
