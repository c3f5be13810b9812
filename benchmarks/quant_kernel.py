"""The quantized linear kernels on this CPU, at SmolLM2's shapes, against the alternatives: tokenmill's C kernels
(int4 / int8 weights x int8 activations: kernels/cpu/quant_linear.c row at a time, int4 with fp16 and with float32
scales; and, on a host with AVX-512 VNNI or AVX2, kernels/cpu/quant_linear_x16.c over the interleaved layout, with
AMX its tile build too),
PyTorch's own int4 CPU matmul (``_weight_int4pack_mm_for_cpu``: bf16 activations, (q - 8) * scale + zero) and int8
weight-only matmul (``_weight_int8pack_mm``, per channel), and the dense float32 and bfloat16 weights packed for
oneDNN (what tokenmill runs otherwise). Each case walks as many weight copies as the model has layers of that shape,
up to 96 MB (cold, as a decode step reads them); fastest of interleaved rounds.

    python benchmarks/quant_kernel.py [--rows 1,4,16,64] [--threads 2] [--shapes qkv,o] [--cases "interleaved,dense bf16"]
        [--out benchmarks/results/quant-kernel.json]

``--shapes`` and ``--cases`` keep only the named shapes and the cases whose name contains one of the given words
(the torch int8 weight-only case alone takes seconds a call at hundreds of rows).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from tokenmill.kernels.cpu_linear import pack_weight, packed_linear
from tokenmill.kernels.cpu_native import amx_available, x16_available
from tokenmill.kernels.quant_linear import CPUQuantMatmul, WeightFormat, quantize

SHAPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30),
          "lm_head": (49152, 576, 1)}
COLD_BYTES = 96 * 2**20


def best_of(works: dict, rounds: int = 7, budget_s: float = 2.0) -> dict[str, float]:
    best = {name: math.inf for name in works}
    start = time.perf_counter()
    for r in range(rounds):
        for name, work in (works.items() if r % 2 == 0 else reversed(works.items())):
            t0 = time.perf_counter()
            work()
            best[name] = min(best[name], time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s and r >= 2:
            break
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--cases", default=None, help="comma-separated words; a case runs if its name contains one")
    parser.add_argument("--out", default="benchmarks/results/quant-kernel.json")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: choose from {list(SHAPES)}")
    wanted = args.cases.split(",") if args.cases else None
    torch.set_num_threads(args.threads)
    int4, int8 = WeightFormat.parse("int4-g32"), WeightFormat.parse("int8-g32")
    results = []
    with torch.inference_mode():
        for name in shapes:
            out, inp, count = SHAPES[name]
            copies = max(1, min(count, COLD_BYTES // (out * inp * 4)))
            dense = [torch.randn(out, inp) / math.sqrt(inp) for _ in range(copies)]
            packed = [pack_weight(w) for w in dense]
            packed_bf16 = [pack_weight(w.bfloat16()) for w in dense]
            q4 = [quantize(w, int4) for w in dense]
            q8 = [quantize(w, int8) for w in dense]
            k4 = [CPUQuantMatmul(int4, q["qweight"], q["scales"], q["mins"], interleaved=False) for q in q4]
            k4f = [CPUQuantMatmul(int4, q["qweight"], q["scales"].float(), q["mins"].float(), interleaved=False)
                   for q in q4]
            k8 = [CPUQuantMatmul(int8, q["qweight"], q["scales"], None, interleaved=False) for q in q8]
            x16 = x16_available()
            k4x = [CPUQuantMatmul(int4, q["qweight"], q["scales"], q["mins"]) for q in q4] if x16 else []
            k8x = [CPUQuantMatmul(int8, q["qweight"], q["scales"], None) for q in q8] if x16 else []
            amx = x16 and amx_available()
            k4a = [CPUQuantMatmul(int4, q["qweight"], q["scales"], q["mins"], amx_from_rows=1) for q in q4] if amx else []
            k8a = [CPUQuantMatmul(int8, q["qweight"], q["scales"], None, amx_from_rows=1) for q in q8] if amx else []
            codes = [torch.randint(0, 16, (out, inp), dtype=torch.int32) for _ in range(copies)]
            torch_int4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(c, 1) for c in codes]
            sz = torch.randn(inp // 32, out, 2).bfloat16()
            w8 = [torch.randint(-127, 127, (out, inp), dtype=torch.int8) for _ in range(copies)]
            s8 = torch.randn(out)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, inp)
                xb = x.bfloat16()
                works = {
                    "dense fp32 packed": lambda: [packed_linear(x, p, None) for p in packed],
                    **({"dense bf16 packed": lambda: [packed_linear(xb, p, None) for p in packed_bf16]}
                       if all(p is not None for p in packed_bf16) else {}),  # oneDNN packs bf16 from AVX-512 up
                    "tokenmill int4-g32 (fp16 scales)": lambda: [k(x) for k in k4],
                    "tokenmill int4-g32 (fp32 scales)": lambda: [k(x) for k in k4f],
                    "tokenmill int8-g32": lambda: [k(x) for k in k8],
                    **({"tokenmill int4-g32 interleaved": lambda: [k(x) for k in k4x],
                        "tokenmill int8-g32 interleaved": lambda: [k(x) for k in k8x]} if x16 else {}),
                    **({"tokenmill int4-g32 AMX": lambda: [k(x) for k in k4a],
                        "tokenmill int8-g32 AMX": lambda: [k(x) for k in k8a]} if amx else {}),
                    "torch int4 (bf16 activations)": lambda: [
                        torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w, 32, sz) for w in torch_int4],
                    "torch int8 weight-only (per channel)": lambda: [
                        torch.ops.aten._weight_int8pack_mm(x, w, s8) for w in w8],
                }
                if wanted:
                    works = {k: v for k, v in works.items() if any(word in k for word in wanted)}
                for work in works.values():
                    work()
                best = best_of(works)
                row = {"shape": name, "out": out, "in": inp, "copies": copies, "rows": rows,
                       "us_per_call": {k: v / copies * 1e6 for k, v in best.items()}}
                results.append(row)
                print(name, rows, ", ".join(f"{k}: {v:.1f} us" for k, v in row["us_per_call"].items()))
    Path(args.out).write_text(json.dumps({
        "command": f"python benchmarks/quant_kernel.py --rows {args.rows} --threads {args.threads} --shapes "
                   f"{args.shapes}" + (f" --cases '{args.cases}'" if args.cases else ""),
        "torch": torch.__version__, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
