"""The model's linear layers on this machine's CPU, by weight layout: plain weights (``F.linear``, what tokenmill runs
today) against the same weights packed once (MKL's packed sgemm for float32; oneDNN's blocked layout, what vLLM's CPU
build runs) -- the measurement behind issue 24's prepacked GEMMs.

For every distinct linear shape of the model (one decoder layer's projections and the LM head) and every row count
``--rows`` (the batch sizes the scheduler makes at decode, and a prefill chunk), the layouts are timed in interleaved
rounds (best of each round's repeats; best over ``--rounds``): a neighbour busy for a round slows every layout alike.
Each packed result is checked against ``F.linear`` before it is timed. Also prints, per row count, the sum over one
decoder layer x the layer count + the LM head: the GEMM share of a decode step.

    python benchmarks/cpu_gemm.py [--dtype float32] [--rows 1,4,16,32,64,256] [--out benchmarks/results/cpu-gemm.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.models.config import ModelConfig
from tokenmill.models.loader import open_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """name -> (out_features, in_features, uses per step): one decoder layer's projections (per layer) and the LM head."""
    hidden, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    layers = config.num_layers
    return {"qkv_proj": (q + 2 * kv, hidden, layers), "o_proj": (hidden, q, layers),
            "gate_up_proj": (2 * config.intermediate_size, hidden, layers),
            "down_proj": (hidden, config.intermediate_size, layers), "lm_head": (config.vocab_size, hidden, 1)}


def layouts(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each layout as a function of x [rows, in] -> [rows, out]; the packing is done here, once."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"plain": lambda x: F.linear(x, weight)}
    if torch.backends.mkldnn.is_available():
        try:  # an opaque oneDNN tensor; one packing serves any row count
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        except RuntimeError as exc:  # e.g. bf16 without AVX-512 or AVX-NE-CONVERT: oneDNN refuses to pack
            print(f"  oneDNN cannot pack {weight.dtype} here: {exc}")
        else:
            out["onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if weight.dtype == torch.float32 and torch.backends.mkl.is_available():
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        out["mkl_packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl, weight, None, rows)
    return out


def best_time(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(out_f: int, in_f: int, rows: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_f, in_f, generator=gen) * 0.02).to(dtype)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    reference = F.linear(x, weight).float()
    fns = layouts(weight, rows)
    for name, fn in fns.items():
        err = (fn(x).float() - reference).abs().max().item()
        assert err <= 1e-3 * max(1.0, reference.abs().max().item()), f"{name}: max error {err}"
    flops = 2 * rows * out_f * in_f
    repeats = max(3, min(200, int(2e8 / flops)))
    best = {name: float("inf") for name in fns}
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            best[name] = min(best[name], best_time(lambda: fn(x), repeats))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--rows", default="1,4,16,32,64,256")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu-gemm.json"))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig.from_hf(open_checkpoint(args.model).hf_config)
    rows_list = [int(r) for r in args.rows.split(",")]
    results: dict[str, dict[str, dict[str, float]]] = {}
    step: dict[int, dict[str, float]] = {}
    for name, (out_f, in_f, uses) in linear_shapes(config).items():
        results[name] = {}
        for rows in rows_list:
            best = measure(out_f, in_f, rows, DTYPES[args.dtype], args.rounds)
            results[name][str(rows)] = {k: round(v * 1e6, 1) for k, v in best.items()}
            totals = step.setdefault(rows, {})
            for layout, seconds in best.items():
                totals[layout] = totals.get(layout, 0.0) + seconds * uses
            shown = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in best.items())
            print(f"{name} [{out_f}x{in_f}] rows={rows}: {shown}", flush=True)
    print("GEMMs of one decode step (every layer + LM head), ms:")
    for rows, totals in step.items():
        print(f"  rows={rows}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in totals.items()))
    record = {"command": " ".join(["python benchmarks/cpu_gemm.py", *argv]), "date": time.strftime("%Y-%m-%d"),
              "cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "dtype": args.dtype, "model": config.architecture,
              "microseconds": results,
              "step_ms": {str(r): {k: round(v * 1e3, 2) for k, v in t.items()} for r, t in step.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
