"""Decode attention of one layer over the paged cache, by kernel backend and cache dtype, on this machine's CPU.

The PyTorch reference (kernels/paged_attention.py, backend "torch": gathers each request's K/V, then SDPA) and the C
kernel (kernels/cpu/paged_attention.c, backend "cpu": reads the cache in place) at SmolLM2's shapes (9 query heads,
3 KV heads, head size 64): each request decodes one token over a ``--context``-token history scattered over permuted
blocks. The cache dtypes and backends are timed alternately in one process (best of ``--repeats`` per round, best
round kept), so the ratios hold even on a noisy machine. This is the measurement behind ``kv_cache_dtype=auto``
choosing bf16 on a CPU and ``kernel_backend=auto`` choosing the C kernel there.

The queries are what a model of the cache's dtype makes: bf16 over a bf16 or fp8 cache (a bf16 model; the C kernel's
bf16 path takes bf16 queries over a bf16 cache), float32 over a float32 cache; ``--q-dtypes model,fp32`` also times
float32 queries over the same caches (the widening path everywhere) in turn.

``--prefetch-targets l1,l2`` times the C kernel asking for the next cache block into the L1 and into the L2 in turn
(what engine/attention_prefetch.py settles at start-up).

``--layers N`` times each call on the next of N separate caches (as a model's N layers are), so the cache comes from
memory, not from a warm last-level cache.

    python benchmarks/decode_attention.py [--batch 1,16,32] [--context 320] [--threads 1] [--backends torch,cpu]
        [--q-dtypes model,fp32] [--prefetch-targets l1,l2] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from tokenmill.kernels.cpu_attention import set_prefetch_target
from tokenmill.kernels.kv_write import write_kv_reference
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.paged_attention import paged_attention

HQ, HKV, DIM, BLOCK = 9, 3, 64, 16
STORAGE = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


def decode_inputs(batch: int, context: int, kv_dtype: str, q_dtype: torch.dtype = torch.float32):
    blocks_per_request = -(-context // BLOCK)
    num_blocks = batch * blocks_per_request
    data = torch.zeros(num_blocks + 1, BLOCK, 2 * HKV, DIM, dtype=STORAGE[kv_dtype])
    scales = torch.zeros(num_blocks + 1, BLOCK, 2 * HKV) if kv_dtype == "fp8" else None
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).view(batch, blocks_per_request)
    pos = torch.arange(context)
    slots = (tables[:, pos // BLOCK] * BLOCK + pos % BLOCK).reshape(-1)
    write_kv_reference(data, scales, torch.randn(slots.shape[0], 2 * HKV, DIM), slots)
    meta = AttentionMetadata(slot_mapping=slots[context - 1::context], query_start_loc=list(range(batch + 1)),
                             seq_lens=[context] * batch, block_tables=tables, block_size=BLOCK,
                             decode_indices=list(range(batch)), prefill_indices=[])
    q = torch.randn(batch, HQ, DIM).to(q_dtype)
    return q, data, scales, meta


def query_dtype(kv_dtype: str, choice: str) -> torch.dtype:
    return torch.float32 if choice == "fp32" or kv_dtype == "fp32" else torch.bfloat16


def best_seconds(layers: list[tuple], repeats: int, backend: str) -> float:
    times = []
    for i in range(repeats):
        q, data, scales, meta = layers[i % len(layers)]
        meta._derived.clear()  # the per-step slot table is built in every timed call, as in a real step's first layer
        start = time.perf_counter()
        paged_attention(q, q[:, :HKV], q[:, :HKV], data, scales, meta, DIM ** -0.5, backend=backend)
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,16,32")
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backends", default="torch,cpu")
    parser.add_argument("--q-dtypes", default="model",
                        help="model (bf16 queries over bf16/fp8 caches, float32 over float32) and/or fp32")
    parser.add_argument("--prefetch-targets", default="l1",
                        help="the C kernel's prefetch targets, timed in turn: l1 and/or l2")
    parser.add_argument("--layers", type=int, default=1, help="separate caches, timed in turn")
    parser.add_argument("--out", default="benchmarks/results/decode-attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backends, q_choices, targets = args.backends.split(","), args.q_dtypes.split(","), args.prefetch_targets.split(",")
    # (backend, cache dtype, query choice, prefetch target); a float32 cache's queries are float32 whichever the
    # choice, and only the C kernel prefetches
    cases = [(b, kv, qc, pf) for b in backends for kv in STORAGE for qc in q_choices for pf in targets
             if (kv != "fp32" or qc == q_choices[0]) and (b == "cpu" or pf == targets[0])]
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        inputs = {(kv, qc): [decode_inputs(batch, args.context, kv, query_dtype(kv, qc)) for _ in range(args.layers)]
                  for _, kv, qc, _ in cases}
        best = {case: float("inf") for case in cases}
        for _ in range(args.rounds):
            for b, kv, qc, pf in cases:
                set_prefetch_target(pf)
                best[b, kv, qc, pf] = min(best[b, kv, qc, pf], best_seconds(inputs[kv, qc], args.repeats, b))
        name = {case: "_".join(case[:2]) + ("_fp32q" if case[2] == "fp32" and case[1] != "fp32" else "")
                + ("_l2" if case[3] == "l2" else "") for case in cases}
        q0, pf0 = q_choices[0], targets[0]
        row = {"batch": batch, "context": args.context, **{f"{name[c]}_ms": best[c] * 1e3 for c in cases},
               **{f"{b}_fp8_over_bf16": best[b, "fp8", q0, pf0] / best[b, "bf16", q0, pf0] for b in backends}}
        if "torch" in backends and "cpu" in backends:
            row.update({f"cpu_over_torch_{kv}": best["cpu", kv, q0, pf0] / best["torch", kv, q0, pf0]
                        for kv in STORAGE})
        if set(q_choices) == {"model", "fp32"}:
            row.update({f"{b}_bf16_over_bf16_fp32q": best[b, "bf16", "model", pf0] / best[b, "bf16", "fp32", pf0]
                        for b in backends})
        if "cpu" in backends and set(targets) == {"l1", "l2"}:
            row.update({f"cpu_{kv}_l2_over_l1": best["cpu", kv, q0, "l2"] / best["cpu", kv, q0, "l1"]
                        for kv in STORAGE})
        rows.append(row)
        print(f"batch {batch:3d}: " + "  ".join(f"{name[c]} {best[c] * 1e3:7.3f} ms" for c in cases))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/decode_attention.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    out.write_text(json.dumps({"command": command, "machine": cpu_name(), "torch": torch.__version__,
                               "threads": args.threads, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
