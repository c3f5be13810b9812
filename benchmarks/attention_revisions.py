"""The C decode-attention kernel (kernels/cpu/paged_attention.c) of two git revisions, side by side in one process.

Each revision's kernel source is taken with ``git show REV:tokenmill/kernels/cpu/paged_attention.c`` (``worktree``:
the file as it is now), built with kernels/cpu_native.py's compiler flags into its own library, and timed on the same
inputs in turn (rounds alternate the revisions; the best of ``--repeats`` per round, the best round kept), so the
ratio holds on a noisy machine where two runs an hour apart would not. The inputs are benchmarks/decode_attention.py's
(SmolLM2's heads: a bf16 model's bf16 queries over a bf16 cache, or ``--kv-dtype fp8`` an fp8 one, ``--batch`` requests of ``--context`` tokens on
permuted blocks of 16), each call a model layer's whole decode batch, through the same ctypes call the engine makes.
Two cases per revision: ``warm`` (one layer's cache, again and again: the kernel's own work) and ``memory`` (each
call the next of ``--layers`` caches, as a model's layers are: the cache comes from memory).

    python benchmarks/attention_revisions.py --before HEAD~1 [--after worktree] [--batch 1,16,32] [--context 290]
        [--kv-dtype bf16|fp8]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_attention import cpu_name, decode_inputs  # noqa: E402

from tokenmill.kernels.cpu_attention import KINDS, _segments  # noqa: E402
from tokenmill.kernels.cpu_native import FLAGS, _compiler  # noqa: E402

SOURCE = "tokenmill/kernels/cpu/paged_attention.c"


def build(revision: str, workdir: Path) -> ctypes.CDLL:
    text = Path(SOURCE).read_text() if revision == "worktree" else subprocess.run(
        ["git", "show", f"{revision}:{SOURCE}"], check=True, capture_output=True, text=True).stdout
    name = revision.replace("/", "_").replace("~", "_").replace("^", "_")
    source, library = workdir / f"{name}.c", workdir / f"{name}.so"
    source.write_text(text)
    # the worktree's shared header serves every revision that includes it
    subprocess.run([_compiler(), *FLAGS, f"-I{Path(SOURCE).parent}", str(source), "-o", str(library), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(library))
    lib.tm_init()
    lib.tm_paged_attention.restype = ctypes.c_int
    lib.tm_paged_attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64] + \
        [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5 + [ctypes.c_float] * 2 + [ctypes.c_int] * 2
    lib.tm_set_attention_prefetch.argtypes = [ctypes.c_int]
    return lib


def attend(lib: ctypes.CDLL, q: torch.Tensor, data: torch.Tensor, scales: torch.Tensor | None, tables: torch.Tensor,
           segments: torch.Tensor) -> torch.Tensor:
    """kernels/cpu_attention.cache_attention's call, on this library (bf16 queries, no softcap)."""
    q32 = q.float().contiguous()
    out, lse = torch.empty_like(q32), torch.empty(q32.shape[:2])
    code = lib.tm_paged_attention(
        q32.data_ptr(), out.data_ptr(), lse.data_ptr(), data.data_ptr(),
        scales.data_ptr() if scales is not None else None, KINDS[data.dtype], tables.data_ptr(),
        tables.stride(0), *(segments[i].data_ptr() for i in range(5)), segments.shape[1], q32.shape[1],
        data.shape[2] // 2, q32.shape[2], data.shape[1], q32.shape[2] ** -0.5, 0.0, int(q.dtype == torch.bfloat16),
        torch.get_num_threads())
    assert code == 0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a git revision, or 'worktree'")
    parser.add_argument("--after", default="worktree")
    parser.add_argument("--batch", default="1,16,32")
    parser.add_argument("--context", type=int, default=290)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefetch-target", choices=("l1", "l2"), default="l2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/attention-revisions.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {rev: build(rev, Path(tmp)) for rev in (args.before, args.after)}
        for lib in libs.values():
            lib.tm_set_attention_prefetch(int(args.prefetch_target == "l2"))
        rows = []
        for batch in (int(b) for b in args.batch.split(",")):
            layers = []
            for _ in range(args.layers):
                q, data, scales, meta = decode_inputs(batch, args.context, args.kv_dtype, torch.bfloat16)
                layers.append((q, data, scales, meta.block_tables.long().contiguous(), _segments(meta, 0, True)))
            first = {rev: attend(lib, *layers[0]) for rev, lib in libs.items()}
            gap = (first[args.after] - first[args.before]).abs().max().item()
            best = {}
            for _ in range(args.rounds):
                for rev, lib in libs.items():
                    for case in ("warm", "memory"):
                        times = []
                        for _ in range(args.repeats):
                            start = time.perf_counter()
                            for i in range(args.layers):
                                attend(lib, *layers[0 if case == "warm" else i])
                            times.append((time.perf_counter() - start) / args.layers)
                        best[rev, case] = min(best.get((rev, case), float("inf")), min(times))
            row = {"batch": batch, "context": args.context, "max_abs_difference": gap,
                   **{f"{case}_ms": {rev: best[rev, case] * 1e3 for rev in libs} for case in ("warm", "memory")},
                   **{f"{case}_after_over_before": best[args.after, case] / best[args.before, case]
                      for case in ("warm", "memory")}}
            rows.append(row)
            print(f"batch {batch:3d}: " + "  ".join(
                f"{case} {best[args.before, case] * 1e3:.3f} -> {best[args.after, case] * 1e3:.3f} ms "
                f"({row[f'{case}_after_over_before']:.2f}x)" for case in ("warm", "memory")) + f"  |diff| {gap:.2g}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/attention_revisions.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    out.write_text(json.dumps({"command": command, "machine": cpu_name(), "threads": args.threads,
                               "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
