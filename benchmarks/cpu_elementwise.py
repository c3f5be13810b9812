"""SwiGLU's silu(gate) * up on a CPU: the C kernel (kernels/cpu/gated_activation.c, through
kernels/gated_activation.py) against inductor's fused loop for the same expression (torch.compile, dynamic shapes,
what a compiled step made before), at SmolLM2's MLP width (2 x 1536) over ``--rows`` rows of bf16, one process,
the two called in interleaved rounds (fastest round kept, us a call). Each call's input is the next of ``--copies``
cold copies (as a model's layers are), so both read from memory, not from a warm cache.

    python benchmarks/gated_activation.py [--rows 1,32,2048] [--threads 2] [--out benchmarks/results/gated-activation.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.kernels.gated_activation import silu_mul


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def inductor_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def best_us(fn, inputs: list[torch.Tensor], calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(inputs[i % len(inputs)])
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,32,2048")
    parser.add_argument("--inter", type=int, default=1536)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/gated-activation.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiled = torch.compile(inductor_silu_mul, dynamic=True)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, 2 * args.inter).bfloat16() for _ in range(args.copies)]
        torch._dynamo.mark_dynamic(inputs[0], 0)
        compiled(inputs[0])  # compile outside the timing
        calls = max(args.copies, min(2000, 2_000_000 // (rows * args.inter)))
        best = {"c_kernel": float("inf"), "inductor": float("inf")}
        for _ in range(args.rounds):
            for name, fn in (("c_kernel", silu_mul), ("inductor", compiled)):
                best[name] = min(best[name], best_us(fn, inputs, calls))
        results.append({"rows": rows, "inter": args.inter, **{f"{k}_us": v for k, v in best.items()},
                        "inductor_over_c": best["inductor"] / best["c_kernel"]})
        print(f"{rows:5d} rows: C {best['c_kernel']:.1f} us, inductor {best['inductor']:.1f} us "
              f"({best['inductor'] / best['c_kernel']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads,
                                          "torch": torch.__version__, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
