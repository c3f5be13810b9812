"""The C elementwise kernels of a CPU step against inductor's fused loops for the same expressions (torch.compile,
dynamic shapes: what a compiled step made before each kernel), at SmolLM2's sizes over ``--rows`` tokens of bf16,
one process, the two called in interleaved rounds (fastest round kept, us a call). Each call's input is the next of
``--copies`` cold copies (as a model's layers are), so both read from memory, not from a warm cache.

- ``silu_mul``: SwiGLU's silu(gate) * up over the fused [gate | up] projection (kernels/cpu/gated_activation.c);
- ``rope_qk``: the rotary embedding of q and k in the fused qkv projection's rows, at random positions: the C kernel
  in place (kernels/cpu/rotary.c through rope_qk_inplace, as a step runs it), inductor's loop writing copies of q
  and k (as a step ran it before).

    python benchmarks/cpu_elementwise.py [--kernels silu_mul,rope_qk] [--rows 1,32,2048] [--threads 2] \
        [--out benchmarks/results/cpu-elementwise.json]
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
from tokenmill.kernels.rotary import rope_qk_inplace, rotate_reference
from tokenmill.models.layers.rotary import RotaryEmbedding

# SmolLM2-135M's shapes
INTER, HEADS, KV_HEADS, HEAD_DIM, MAX_POSITION = 1536, 9, 3, 64, 8192


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def inductor_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def qk_views(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, _ = fused.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM)


def kernel_pairs(kernel: str, rows: int, copies: int):
    """(inputs, the C kernel's call, the compiled reference's call) for one kernel at ``rows`` tokens."""
    if kernel == "silu_mul":
        inputs = [torch.randn(rows, 2 * INTER).bfloat16() for _ in range(copies)]
        torch._dynamo.mark_dynamic(inputs[0], 0)
        return inputs, silu_mul, torch.compile(inductor_silu_mul, dynamic=True), INTER
    if kernel == "rope_qk":
        table = RotaryEmbedding(HEAD_DIM, MAX_POSITION, {"rope_theta": 100000.0, "rope_type": "default"})
        cos, sin = table.cos, table.sin

        def reference(fused, positions):
            q, k = qk_views(fused)
            return rotate_reference(q, positions, cos, sin), rotate_reference(k, positions, cos, sin)

        def c_kernel(fused, positions):
            return rope_qk_inplace(fused, positions, cos, sin, HEADS, KV_HEADS)

        inputs = [(torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16(),
                   torch.randint(0, MAX_POSITION, (rows,))) for _ in range(copies)]
        torch._dynamo.mark_dynamic(inputs[0][0], 0)
        torch._dynamo.mark_dynamic(inputs[0][1], 0)
        return inputs, c_kernel, torch.compile(reference, dynamic=True), (HEADS + KV_HEADS) * HEAD_DIM
    raise ValueError(f"unknown kernel {kernel!r} (silu_mul, rope_qk)")


def time_us(fn, inputs: list, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        x = inputs[i % len(inputs)]
        fn(*x) if isinstance(x, tuple) else fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="silu_mul,rope_qk")
    parser.add_argument("--rows", default="1,32,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/cpu-elementwise.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for kernel in args.kernels.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            inputs, c_kernel, compiled, width = kernel_pairs(kernel, rows, args.copies)
            first = inputs[0]
            compiled(*first) if isinstance(first, tuple) else compiled(first)  # compile outside the timing
            calls = max(args.copies, min(2000, 2_000_000 // (rows * width)))
            best = {"c_kernel": float("inf"), "inductor": float("inf")}
            for _ in range(args.rounds):
                for name, fn in (("c_kernel", c_kernel), ("inductor", compiled)):
                    best[name] = min(best[name], time_us(fn, inputs, calls))
            results.append({"kernel": kernel, "rows": rows, **{f"{k}_us": v for k, v in best.items()},
                            "inductor_over_c": best["inductor"] / best["c_kernel"]})
            print(f"{kernel} {rows:5d} rows: C {best['c_kernel']:.1f} us, inductor {best['inductor']:.1f} us "
                  f"({best['inductor'] / best['c_kernel']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads,
                                          "torch": torch.__version__, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
