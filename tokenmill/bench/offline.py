"""Offline throughput: tokenmill's engine vs transformers' batched ``generate`` on the same weights, one run.

    python -m tokenmill.bench.offline [--num-requests 64 --input-len 128 --output-len 128]

Prompts are random token ids of exact length; every request generates exactly ``output-len`` tokens
(EOS ignored on both sides), so both engines do the same work. Reports output tokens/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.models.loader import DEFAULT_MODEL_FILE, default_model_path


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the first ids: SmolLM2's special tokens live there.
    return torch.randint(100, vocab, (num, length), generator=g).tolist()


def bench_tokenmill(prompts, output_len: int, **config) -> dict:
    llm = LLM(**config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    return {"engine": "tokenmill", "config": {k: str(v) for k, v in config.items()},
            "seconds": elapsed, "output_tokens": produced, "output_tok_per_s": produced / elapsed}


def bench_transformers(prompts, output_len: int, dtype: torch.dtype, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=DEFAULT_MODEL_FILE, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: exactly output_len tokens each
    model.generation_config.pad_token_id = 0

    def run(batch):
        ids = torch.tensor(batch)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    run(prompts[:2])  # warm-up
    start = time.perf_counter()
    produced = sum(run(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size))
    elapsed = time.perf_counter() - start
    return {"engine": "transformers.generate", "config": {"dtype": str(dtype), "batch_size": batch_size},
            "seconds": elapsed, "output_tokens": produced, "output_tok_per_s": produced / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="tokenmill compute dtypes to measure")
    parser.add_argument("--kv-cache-dtypes", default="fp8", help="tokenmill KV cache dtypes to measure")
    parser.add_argument("--hf-dtypes", default="float32,bfloat16", help="transformers dtypes to measure")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", help="write all results to this file")
    args = parser.parse_args(argv)

    prompts = random_prompts(args.num_requests, args.input_len, 49152, args.seed)
    results = []
    for dtype in args.dtypes.split(","):
        for kv in args.kv_cache_dtypes.split(","):
            results.append(bench_tokenmill(prompts, args.output_len, dtype=dtype, kv_cache_dtype=kv))
            print(json.dumps(results[-1]), flush=True)
    for dtype in [] if args.skip_transformers else args.hf_dtypes.split(","):
        results.append(bench_transformers(prompts, args.output_len, getattr(torch, dtype), args.hf_batch_size))
        print(json.dumps(results[-1]), flush=True)

    print(f"\n{args.num_requests} requests x ({args.input_len} prompt + {args.output_len} output) tokens, "
          f"torch threads {torch.get_num_threads()}\n")
    print("| engine | config | seconds | output tok/s |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['config']} | {r['seconds']:.1f} | {r['output_tok_per_s']:.1f} |")
    ours = [r for r in results if r["engine"] == "tokenmill"]
    for base in (r for r in results if r["engine"] != "tokenmill"):
        for r in ours:
            ratio = r["output_tok_per_s"] / base["output_tok_per_s"]
            print(f"tokenmill {r['config']} / transformers {base['config']['dtype']}: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
