"""Kernel benchmark: each Triton kernel against its baselines at SmolLM2 and DeepSeek shapes, batch 1..256, and the
quantized dense linear layers (fp8 W8A8, int4 weight-only) against the dense GEMM.

For every case it prints the time of the Triton kernel and of each baseline (the PyTorch reference the CPU runs;
for attention also ``scaled_dot_product_attention`` over dense, unpaged 16-bit K/V: what paging and fp8 must
compete with), the achieved TFLOP/s and GB/s of the Triton kernel, and their fraction of the GPU's peak
(``PEAKS``; "n/a" for a GPU not listed). Bytes count what the kernel must move at least (weights of the experts
actually hit, the cache entries read, the activations); FLOPs count multiply-adds twice. For the quantized linear
layers the "triton ms" column is the format's op as the dispatch runs it, and the baseline the dense GEMM.

    python benchmarks/kernel_speeds.py              # on a CUDA GPU (~30 s on one H200: BENCHMARKS.md, "On a GPU")
    TRITON_INTERPRET=1 python benchmarks/kernel_speeds.py --smoke   # tiny shapes on CPU: proves the script runs
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels.backend import FP8_MIN_CAPABILITY
from tokenmill.kernels.fp8 import quantize_fp8_blocks
from tokenmill.kernels.fused_moe import Fp8BlockScales, fused_moe
from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.mla import mla_decode
from tokenmill.kernels.paged_attention import paged_attention
from tokenmill.kernels.quant_linear import WeightFormat, fp8_w8a8_linear, quant_linear, quantize

# Dense peak (no sparsity): (bf16 TFLOP/s, fp8 TFLOP/s, memory TB/s), by a substring of the device name.
PEAKS = {"H200": (989.0, 1979.0, 4.8), "H100": (989.0, 1979.0, 3.35), "A100": (312.0, None, 2.0),
         "L40S": (362.0, 733.0, 0.864)}


@dataclass(frozen=True)
class Shape:
    name: str
    kv_heads: int = 0
    q_heads: int = 0
    head_dim: int = 0
    rank: int = 0
    rope: int = 0
    experts: int = 0
    inter: int = 0
    hidden: int = 0
    top_k: int = 0


FULL = dict(
    smollm2=Shape("SmolLM2-135M", kv_heads=3, q_heads=9, head_dim=64),
    v3=Shape("DeepSeek-V3", q_heads=128, rank=512, rope=64, experts=256, inter=2048, hidden=7168, top_k=8),
    v2_lite=Shape("DeepSeek-V2-Lite", q_heads=16, rank=512, rope=64, experts=64, inter=1408, hidden=2048, top_k=6),
    # Dense linear layers (out, in): SmolLM2's gate_up and a Llama-3-8B down_proj.
    linears=(("SmolLM2 gate_up", 3072, 576), ("Llama-3-8B down", 4096, 14336)),
    batches=(1, 4, 16, 64, 256), context=2048)
SMOKE = dict(
    smollm2=Shape("SmolLM2-like (smoke)", kv_heads=2, q_heads=4, head_dim=32),
    v3=Shape("DeepSeek-like (smoke)", q_heads=4, rank=32, rope=16, experts=8, inter=32, hidden=48, top_k=2),
    v2_lite=None, linears=(("linear (smoke)", 64, 128),), batches=(1, 4), context=40)


def timer(device: torch.device, reps: int) -> Callable[[Callable[[], object]], float]:
    """-> ms per call (median-ish: triton's do_bench on CUDA; best of ``reps`` on CPU)."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=3, rep=max(10, reps * 5))

    def host(fn):
        fn()
        best = math.inf
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best * 1e3
    return host


class Table:
    def __init__(self, peaks):
        self.peaks = peaks
        self.rows = [("kernel", "shape", "batch", "triton ms", "baselines ms", "TFLOP/s", "GB/s", "% peak")]

    def add(self, kernel, shape, batch, t_ms, baselines: dict[str, float], flops, bytes_, fp8_math=False):
        tflops, gbs = flops / t_ms / 1e9, bytes_ / t_ms / 1e6
        frac = "n/a"
        if self.peaks:
            compute_peak = self.peaks[1] if fp8_math and self.peaks[1] else self.peaks[0]
            frac = f"{100 * tflops / compute_peak:.0f}% math, {100 * gbs / (self.peaks[2] * 1e3):.0f}% mem"
        base = ", ".join(f"{k} {v:.3f}" for k, v in baselines.items())
        self.rows.append((kernel, shape, str(batch), f"{t_ms:.3f}", base, f"{tflops:.2f}", f"{gbs:.0f}", frac))
        print(" | ".join(self.rows[-1]), flush=True)

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.rows[0]) + " |", "|" + "---|" * len(self.rows[0])]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in self.rows[1:]])


def cache_name(fp8: bool, dtype) -> str:
    return "fp8" if fp8 else str(dtype).removeprefix("torch.")


def paged_layout(batch: int, context: int, block_size: int, device) -> tuple[torch.Tensor, int]:
    """Block tables of ``batch`` requests of ``context`` tokens over randomly permuted blocks; -> (tables, blocks)."""
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    return torch.randperm(num_blocks, device=device).view(batch, per_seq), num_blocks


def cache_tensors(shape: tuple[int, ...], fp8: bool, dtype, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random paged cache ``data[shape]`` (+ per-slot scales for fp8) of the cache dtype under test."""
    data = torch.randn(shape, device=device)
    if not fp8:
        return data.to(dtype), None
    return data.to(torch.float8_e4m3fn), torch.rand(shape[:-1], device=device) * 0.01


def bench_kv_write(table, time_fn, shape: Shape, slots: int, dim: int, batch: int, dtype, device, fp8: bool):
    num_blocks = -(-batch // 16) + 1
    data, scales = cache_tensors((num_blocks + 1, 16, slots, dim), fp8, dtype, device)
    new = torch.randn(batch, slots, dim, dtype=dtype, device=device)
    slot_mapping = torch.randperm(num_blocks * 16, device=device)[:batch]
    run = {b: (lambda b=b: write_kv(data, scales, new, slot_mapping, backend=b)) for b in ("triton", "torch")}
    bytes_ = new.numel() * new.element_size() + new.numel() * data.element_size() + batch * slots * 4 * fp8
    table.add(f"kv_write {cache_name(fp8, dtype)}", shape.name, batch, time_fn(run["triton"]),
              {"torch": time_fn(run["torch"])}, 0, bytes_)


def bench_gqa_decode(table, time_fn, s: Shape, batch: int, context: int, dtype, device, fp8: bool):
    block_size = 16
    tables, num_blocks = paged_layout(batch, context, block_size, device)
    data, scales = cache_tensors((num_blocks + 1, block_size, 2 * s.kv_heads, s.head_dim), fp8, dtype, device)
    q = torch.randn(batch, s.q_heads, s.head_dim, dtype=dtype, device=device)
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
                             query_start_loc=list(range(batch + 1)), seq_lens=[context] * batch,
                             block_tables=tables, block_size=block_size, decode_indices=list(range(batch)),
                             prefill_indices=[])
    k_dense = torch.randn(batch, s.kv_heads, context, s.head_dim, dtype=dtype, device=device)
    v_dense = torch.randn_like(k_dense)

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, enable_gqa=True)
    run = {b: (lambda b=b: paged_attention(q, q, q, data, scales, meta, 0.125, backend=b)) for b in ("triton", "torch")}
    flops = 4 * batch * s.q_heads * context * s.head_dim
    bytes_ = batch * context * 2 * s.kv_heads * (s.head_dim * data.element_size() + 4 * fp8)
    table.add(f"paged decode {cache_name(fp8, dtype)} (GQA)", s.name, batch, time_fn(run["triton"]),
              {"torch": time_fn(run["torch"]), "sdpa 16-bit": time_fn(sdpa)}, flops, bytes_)


def bench_mla_decode(table, time_fn, s: Shape, batch: int, context: int, dtype, device, fp8: bool):
    block_size = 16
    tables, num_blocks = paged_layout(batch, context, block_size, device)
    width = s.rank + s.rope
    data, scales = cache_tensors((num_blocks + 1, block_size, 1, width), fp8, dtype, device)
    q_lat = torch.randn(batch, s.q_heads, s.rank, dtype=dtype, device=device)
    q_pe = torch.randn(batch, s.q_heads, s.rope, dtype=dtype, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    latent = torch.randn(batch, 1, context, width, dtype=dtype, device=device)
    q_full = torch.cat([q_lat, q_pe], -1)[:, :, None]  # MQA form of absorbed MLA: K = latent, V = c_kv

    def sdpa():  # 32 requests at a time: all at once, its expanded heads needed 144 GiB at 256 x 4096 on an H200
        for i in range(0, batch, 32):
            F.scaled_dot_product_attention(q_full[i:i + 32], latent[i:i + 32], latent[i:i + 32, ..., :s.rank],
                                           enable_gqa=True)
    run = {b: (lambda b=b: mla_decode(q_lat, q_pe, data, scales, tables, lens, block_size, 0.07, backend=b))
           for b in ("triton", "torch")}
    flops = 2 * batch * s.q_heads * context * (width + s.rank)
    bytes_ = batch * context * (width * data.element_size() + 4 * fp8)
    table.add(f"MLA decode {cache_name(fp8, dtype)}", s.name, batch, time_fn(run["triton"]),
              {"torch": time_fn(run["torch"]), "sdpa 16-bit": time_fn(sdpa)}, flops, bytes_)


@functools.lru_cache(maxsize=3)  # V3 bf16 (22.5 GB) + V2-Lite + V3 fp8 (11.3 GB) stay built
def moe_weights(s: Shape, dtype, device, fp8: bool):
    """Random experts, made one expert at a time (DeepSeek-V3's are 22.5 GB in bf16; quantizing them at once would
    need several times that)."""
    w1 = torch.empty(s.experts, 2 * s.inter, s.hidden, device=device, dtype=torch.float8_e4m3fn if fp8 else dtype)
    w2 = torch.empty(s.experts, s.hidden, s.inter, device=device, dtype=w1.dtype)
    block = (128, 128)
    s1 = torch.empty(s.experts, -(-2 * s.inter // 128), -(-s.hidden // 128), device=device)
    s2 = torch.empty(s.experts, -(-s.hidden // 128), -(-s.inter // 128), device=device)
    for e in range(s.experts):
        for w, scale in ((w1, s1), (w2, s2)):
            values = torch.randn(w.shape[1:], device=device) * 0.02
            if fp8:
                w[e], scale[e] = quantize_fp8_blocks(values, block)
            else:
                w[e] = values.to(dtype)
    return w1, w2, Fp8BlockScales(s1, s2, block) if fp8 else None


def bench_fused_moe(table, time_fn, s: Shape, batch: int, dtype, device, fp8: bool):
    w1, w2, scales = moe_weights(s, dtype, device, fp8)
    x = torch.randn(batch, s.hidden, dtype=dtype, device=device)
    weights, ids = torch.rand(batch, s.experts, device=device).topk(s.top_k, dim=-1)
    run = {b: (lambda b=b: fused_moe(x, w1, w2, weights, ids, scales, backend=b)) for b in ("triton", "torch")}
    hit = s.experts * (1 - (1 - 1 / s.experts) ** (batch * s.top_k))  # expected distinct experts touched
    flops = 6 * batch * s.top_k * s.hidden * s.inter
    bytes_ = hit * 3 * s.inter * s.hidden * w1.element_size() + 2 * batch * s.hidden * x.element_size()
    table.add(f"fused MoE {'fp8 w8a8' if fp8 else str(dtype).removeprefix('torch.')}", s.name, batch,
              time_fn(run["triton"]), {"torch": time_fn(run["torch"])}, flops, bytes_, fp8_math=fp8)


@functools.lru_cache(maxsize=4)
def linear_weights(out_features: int, in_features: int, dtype, device):
    """A random weight in ``dtype`` and as fp8 per channel and int4 with groups of 128 (quantized once per shape)."""
    w = torch.randn(out_features, in_features, device=device) / math.sqrt(in_features)
    return w.to(dtype), {name: quantize(w, WeightFormat.parse(name)) for name in ("fp8-ch", "int4-g128")}


def bench_quant_linear(table, time_fn, name: str, out_features: int, in_features: int, batch: int, dtype, device,
                       fp8: bool):
    """Issue 25's GPU formats against the dense GEMM: fp8 W8A8 (``torch._scaled_mm``, per-token activations) where
    the GPU has fp8, and int4-g128 weight-only as the dispatch runs it (dequantize, then the dense GEMM)."""
    dense, q = linear_weights(out_features, in_features, dtype, device)
    x = torch.randn(batch, in_features, dtype=dtype, device=device)
    baseline = {"dense": time_fn(lambda: F.linear(x, dense))}
    flops = 2 * batch * out_features * in_features
    activations = batch * (in_features + out_features) * x.element_size()
    if fp8:
        t = q["fp8-ch"]
        table.add("linear fp8 w8a8", name, batch, time_fn(lambda: fp8_w8a8_linear(x, t["qweight"], t["scales"], None)),
                  baseline, flops, out_features * in_features + activations, fp8_math=True)
    fmt, t = WeightFormat.parse("int4-g128"), q["int4-g128"]
    run = lambda: quant_linear(x, fmt, t["qweight"], t["scales"], t.get("mins"), backend="triton")  # noqa: E731
    table.add("linear int4-g128 (weight-only)", name, batch, time_fn(run), baseline, flops,
              out_features * in_features // 2 + activations)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU + TRITON_INTERPRET=1 works)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the rows (and the device) to this JSON file")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA GPU here: nothing to measure (run with --smoke and TRITON_INTERPRET=1 to check the script)")
        return 0
    cfg = SMOKE if args.smoke else FULL
    # The interpreter's bf16 tl.dot is wrong and slow; fp16 keeps the smoke run's numbers meaningful.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    peaks = next((p for key, p in PEAKS.items() if key in name), None)
    print(f"device: {name}; peak (bf16 TFLOP/s, fp8 TFLOP/s, TB/s): {peaks or 'n/a'}")
    fp8 = device.type != "cuda" or torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY
    if not fp8:
        print(f"no fp8 in Triton below compute capability 8.9: caches in {dtype}, fp8 MoE skipped")
    table, time_fn = Table(peaks), timer(device, args.reps)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in cfg["batches"]:
            s, v3 = cfg["smollm2"], cfg["v3"]
            bench_kv_write(table, time_fn, s, 2 * s.kv_heads, s.head_dim, batch, dtype, device, fp8)
            bench_kv_write(table, time_fn, v3, 1, v3.rank + v3.rope, batch, dtype, device, fp8)
            bench_gqa_decode(table, time_fn, s, batch, cfg["context"], dtype, device, fp8)
            bench_mla_decode(table, time_fn, v3, batch, cfg["context"], dtype, device, fp8)
            for moe_shape in (v3, cfg["v2_lite"]):
                if moe_shape is not None:
                    bench_fused_moe(table, time_fn, moe_shape, batch, dtype, device, fp8=False)
            if fp8:
                bench_fused_moe(table, time_fn, v3, batch, dtype, device, fp8=True)
            for name, out_features, in_features in cfg["linears"]:
                bench_quant_linear(table, time_fn, name, out_features, in_features, batch, dtype, device, fp8)
    print(f"\n{table.markdown()}\n\ntotal {time.perf_counter() - start:.0f} s")
    if args.json:
        header, rows = table.rows[0], table.rows[1:]
        with open(args.json, "w") as fh:
            command = "python benchmarks/kernel_speeds.py" + (" --smoke" if args.smoke else "")
            json.dump({"command": command, "device": name,
                       "peaks_bf16_tflops_fp8_tflops_tbs": peaks, "rows": [dict(zip(header, r)) for r in rows]},
                      fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
