"""The decodes of a step with prefill chunks, through kernels/cpu/paged_attention.c's bf16 call
(tm_paged_attention_bf16: the call the layer stack and the attention op make for them), two git revisions of that file
side by side in one process (built as attention_revisions.py builds them; rounds alternate the revisions).

Each case: ``decodes`` requests of ``--context`` cached tokens beside a chunk's rows that the call leaves to another
kernel (the step's rows are decodes + chunk), 30 layers' calls a step, each over its own cache. ms a step, best and
median of ``--rounds``.

    python benchmarks/decodes_beside_chunks.py --before REV [--after worktree] [--cases 31x256,8x2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_revisions import build  # noqa: E402
from decode_attention import DIM, HKV, HQ, cpu_name, decode_inputs  # noqa: E402

from tokenmill.kernels.cpu_attention import _segments  # noqa: E402

LAYERS = 30


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.tm_paged_attention_bf16.restype = ctypes.c_int
    lib.tm_paged_attention_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                            ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 5 + \
        [ctypes.c_float] * 2 + [ctypes.c_int]
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a git revision, or 'worktree'")
    parser.add_argument("--after", default="worktree")
    parser.add_argument("--cases", default="31x256,8x2000", help="decodes x chunk rows, comma-separated")
    parser.add_argument("--context", type=int, default=290)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/decodes-beside-chunks.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    libs = {"before": bind(build(args.before, work)), "after": bind(build(args.after, work))}
    results = []
    for case in args.cases.split(","):
        decodes, chunk = (int(n) for n in case.split("x"))
        rows = decodes + chunk
        layers = []
        for _ in range(LAYERS):
            _, data, _, meta = decode_inputs(decodes, args.context, "bf16", torch.bfloat16)
            segments = _segments(meta, 0, with_prefills=False)  # the decodes' rows 0 .. decodes - 1
            layers.append((torch.randn(rows, HQ, DIM).bfloat16(), data, meta.block_tables.long().contiguous(),
                           segments))
        times: dict[str, list[float]] = {name: [] for name in libs}
        for round_ in range(args.rounds):
            for name in list(libs) if round_ % 2 == 0 else list(libs)[::-1]:
                out = torch.empty(rows, HQ, DIM, dtype=torch.bfloat16)
                start = time.perf_counter()
                for q, data, tables, segments in layers:
                    code = libs[name].tm_paged_attention_bf16(
                        q.data_ptr(), q.stride(0), out.data_ptr(), rows, data.data_ptr(), None, 1, tables.data_ptr(),
                        tables.stride(0), *(segments[i].data_ptr() for i in range(6)), segments.shape[1], HQ, HKV,
                        DIM, data.shape[1], DIM ** -0.5, 0.0, args.threads)
                    assert code == 0
                times[name].append((time.perf_counter() - start) * 1e3)
        row = {"decodes": decodes, "chunk_rows": chunk, "ms": times,
               **{f"{name}_best_ms": round(min(t), 2) for name, t in times.items()},
               **{f"{name}_median_ms": round(statistics.median(t), 2) for name, t in times.items()}}
        results.append(row)
        print(f"{decodes} decodes beside {chunk} chunk rows, {LAYERS} layers: " + ", ".join(
            f"{name} {row[f'{name}_best_ms']} / {row[f'{name}_median_ms']} ms" for name in libs), flush=True)
    Path(args.out).write_text(json.dumps({"command": "python benchmarks/decodes_beside_chunks.py " + " ".join(
        sys.argv[1:]), "cpu": cpu_name(), "before": args.before, "after": args.after, "context": args.context,
        "rounds": args.rounds, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
