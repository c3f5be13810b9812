"""Decode attention time per token against context length: dense MLA against DeepSeek Sparse Attention, one attention
layer at DeepSeek-V3.2's shapes (128 heads, kv_lora_rank 512, rope 64, v 128; indexer 64 heads x 128, index_topk
2048), batches 1 and 16, over a paged cache with a shuffled block table.

Times the attention op alone (queries and cache given, W_UK absorbed and W_UV applied in both): dense =
kernels/mla.py's ``mla_attention`` (its decode path); sparse = kernels/dsa.py's ``dsa_attention``: the indexer's
selection over every earlier key plus the attention over the selected latents; and the indexer of one request
alone. On a CPU the PyTorch references run; ``--backend triton`` (on a GPU) runs the Triton kernels of both. Best
of ``--repeats`` after one warm-up; one JSON object per line and a summary to ``--out``.

    python benchmarks/dsa_decode.py --contexts 1024,4096,16384,65536 --batches 1,16 --out benchmarks/results/dsa-decode-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from tokenmill.kernels.dsa import dsa_attention, index_topk_reference
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.mla import mla_attention

HEADS, RANK, ROPE, NOPE, V = 128, 512, 64, 128, 128
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
BLOCK = 64


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def case(batch: int, context: int, repeats: int, backend: str, device: str) -> dict:
    g = torch.Generator().manual_seed(batch * 100_003 + context)
    dtype = torch.bfloat16
    blocks_per = -(-context // BLOCK)
    num_blocks = batch * blocks_per
    data = torch.randn(num_blocks + 1, BLOCK, 1, RANK + ROPE + INDEX_DIM, generator=g).to(dtype).to(device)
    tables = torch.randperm(num_blocks, generator=g).view(batch, blocks_per).to(device)
    q_nope = torch.randn(batch, HEADS, NOPE, generator=g).to(dtype).to(device)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=g).to(dtype).to(device)
    q_index = torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=g).to(dtype).to(device)
    weights = torch.randn(batch, INDEX_HEADS, generator=g).to(device)
    w_kv_b = (torch.randn(HEADS * (NOPE + V), RANK, generator=g) * RANK ** -0.5).to(dtype).to(device)
    scale = (NOPE + ROPE) ** -0.5
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long, device=device),
                             query_start_loc=list(range(batch + 1)), seq_lens=[context] * batch,
                             block_tables=tables, block_size=BLOCK, decode_indices=list(range(batch)),
                             prefill_indices=[])
    dense_data = data[..., :RANK + ROPE].contiguous()  # a dense MLA cache holds no indexer key
    dense = best(lambda: mla_attention(q_nope, q_pe, None, dense_data, None, meta, w_kv_b, scale, backend=backend),
                 repeats)
    sparse = best(lambda: dsa_attention(q_nope, q_pe, q_index, weights, data, None, meta, w_kv_b, scale, TOPK, ROPE,
                                        backend=backend), repeats)
    keys = data.view(-1, data.shape[-1])[:, RANK + ROPE:]
    slots = (tables[0, torch.arange(context, device=device) // BLOCK] * BLOCK
             + torch.arange(context, device=device) % BLOCK)
    index_one = best(lambda: index_topk_reference(q_index[:1], weights[:1], keys[slots].float(),
                                                  torch.tensor([context - 1], device=device), TOPK), repeats)
    return {"batch": batch, "context": context, "backend": backend, "dense_ms": dense * 1e3, "sparse_ms": sparse * 1e3,
            "dense_ms_per_token": dense * 1e3 / batch, "sparse_ms_per_token": sparse * 1e3 / batch,
            "indexer_one_request_ms": index_one * 1e3, "sparse_over_dense": sparse / dense}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,4096,16384,65536")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="torch", choices=["torch", "triton"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if args.backend == "triton" else "cpu"
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            row = case(batch, context, args.repeats, args.backend, device)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"command": "python benchmarks/dsa_decode.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out")
                + f" --out {args.out}", "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
