"""The interleaved int4 / int8 kernel (kernels/cpu/quant_linear_x16.c) of two checkouts side by side in one process:
both trees' C sources built with the flags tokenmill uses, loaded together, called in interleaved rounds on the same
weights and inputs (fastest of the rounds, us a call; the builds' order alternates from round to round), so that the
ratio survives a host whose speed drifts between runs. Weights are gguf's own blocks of ``--format`` (the default
model's Q4_1, the symmetric Q4_0, Q8_0) at SmolLM2's shapes, as many cold copies as the model has layers of the shape
(up to 96 MB); inputs bf16 (the model's CPU dtype). TOKENMILL_CPU_KERNEL_FLAGS (kernels/cpu_native.py) applies to both
builds.

    python benchmarks/x16_builds.py --before /tmp/tokenmill-before [--rows 1,8,32,256,2048] [--format Q4_0]
        [--shapes qkv,o,gate_up,down,lm_head] [--cold-mb 96] [--out benchmarks/results/x16-builds.json]

``--cold-mb`` adds copies until each shape's copies hold that many MB of quantized weight: with more than the L3 holds,
every call reads its weight from memory, as a served step does (a step reads the whole model's weights and, from a
few requests on, more KV cache than the L3 holds).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tokenmill.kernels.cpu_native import EXTRA_FLAGS_ENV, FLAGS, SOURCES, _compiler, cpu_identity
from tokenmill.kernels.quant_linear import CPUQuantMatmul, WeightFormat
from tokenmill.models.loader import GGUF_KEPT_TYPES, gguf_quantized_pieces

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30),
          "lm_head": (49152, 576, 1)}


def build(tree: Path, out: Path) -> ctypes.CDLL:
    sources = [tree / source.relative_to(ROOT) for source in SOURCES]
    extra = os.environ.get(EXTRA_FLAGS_ENV, "").split()  # e.g. -mno-avx512f: both trees' AVX2 builds
    subprocess.run([_compiler(), *FLAGS, *extra, *map(str, sources), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out), mode=ctypes.RTLD_LOCAL)
    lib.tm_init()
    lib.tm_quant_linear_x16.restype = ctypes.c_int
    lib.tm_quant_linear_x16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_int]
    return lib


def gguf_weight(type_name: str, n: int, k: int, rng: np.random.Generator) -> CPUQuantMatmul:
    from gguf import GGMLQuantizationType, quantize

    w = (rng.standard_normal((n, k)) / math.sqrt(k)).astype(np.float32)
    pieces = gguf_quantized_pieces(quantize(w, GGMLQuantizationType[type_name]), type_name)
    t = {key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in pieces.items()}
    return CPUQuantMatmul(WeightFormat.parse(GGUF_KEPT_TYPES[type_name]), t["qweight"], t["scales"], t.get("mins"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="an earlier checkout (git worktree add DIR COMMIT)")
    parser.add_argument("--rows", default="1,8,32,256,2048")
    parser.add_argument("--format", default="Q4_0", choices=sorted(GGUF_KEPT_TYPES))
    parser.add_argument("--shapes", default="qkv,o,gate_up,down", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cold-mb", type=float, default=0.0,
                        help="copies of each shape up to this many MB of quantized weight (default: one per layer)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "x16-builds.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"before": build(Path(args.before), Path(tmp) / "before.so"), "after": build(ROOT, Path(tmp) / "after.so")}
        rng, results = np.random.default_rng(0), []
        for shape in args.shapes.split(","):
            n, k, count = SHAPES[shape]
            kernels = [gguf_weight(args.format, n, k, rng) for _ in range(max(1, min(count, int(96e6 // (n * k * 2)))))]
            if args.cold_mb:  # more copies, each as fresh from memory as a served step's (its weights exceed the L3)
                size = sum(t.numel() * t.element_size() for t in kernels[0]._keep if t is not None)
                kernels += [gguf_weight(args.format, n, k, rng)
                            for _ in range(math.ceil(args.cold_mb * 1e6 / size) - len(kernels))]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k).bfloat16()
                outs = {name: torch.empty(rows, n, dtype=torch.bfloat16) for name in libs}
                best = dict.fromkeys(libs, float("inf"))
                for round_ in range(args.rounds):  # the order alternates: the first-called build ran ~2% faster
                    for name, lib in (list(libs.items()) if round_ % 2 == 0 else list(libs.items())[::-1]):
                        start = time.perf_counter()
                        for kernel in kernels:
                            if lib.tm_quant_linear_x16(kernel._weight_ref, x.data_ptr(), rows, None,
                                                       outs[name].data_ptr(), 1) != 0:
                                raise RuntimeError(f"{name}: the kernel failed")
                        best[name] = min(best[name], (time.perf_counter() - start) / len(kernels) * 1e6)
                diff = (outs["before"].float() - outs["after"].float()).abs().max().item()
                results.append({"shape": shape, "out": n, "in": k, "rows": rows, "us_per_call": best,
                                "before_over_after": best["before"] / best["after"], "max_abs_difference": diff})
                print(f"{shape:8s} rows {rows:5d}: before {best['before']:9.1f} us, after {best['after']:9.1f} us, "
                      f"{best['before'] / best['after']:.2f}x (outputs differ by {diff:g} at most)", file=sys.stderr)
    command = "python benchmarks/x16_builds.py " + " ".join(sys.argv[1:])
    if os.environ.get(EXTRA_FLAGS_ENV):
        command = f"{EXTRA_FLAGS_ENV}='{os.environ[EXTRA_FLAGS_ENV]}' {command}"
    Path(args.out).write_text(json.dumps({"command": command, "cpu": cpu_identity().split("\n")[0],
                                          "format": args.format, "threads": args.threads, "results": results},
                                         indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
