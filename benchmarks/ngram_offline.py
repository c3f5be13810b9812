"""n-gram speculation on the offline engine: the copy dataset's passages (tokenmill bench --dataset copy: texts to
repeat, proofread or quote) as plain completion prompts, greedy, ``--max-tokens`` each, ``--batch`` at a time, with
``speculative_method=ngram``; output tokens/s, median of ``--rounds``. Run it on two trees (PYTHONPATH=TREE for the
other one), alternately, for a before / after of the steps that verify drafts: each is a chunk of 1 + drafts tokens
over its request's cached context.

    python benchmarks/ngram_offline.py [--batch 1,4] [--rounds 3] [--max-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.bench.copy_texts import copy_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--drafts", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--out", default="benchmarks/results/ngram-offline.json")
    args = parser.parse_args()
    llm = LLM(speculative_method="ngram", num_speculative_tokens=args.drafts, kv_cache_memory="512MiB")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(copy_prompts(1), SamplingParams(temperature=0, max_tokens=8))  # warm-up
    results = []
    for batch in (int(b) for b in args.batch.split(",")):
        texts, seconds = copy_prompts(batch), []
        for _ in range(args.rounds):
            start = time.perf_counter()
            outputs = llm.generate(texts, params)
            seconds.append(time.perf_counter() - start)
        tokens = sum(len(o.token_ids) for o in outputs)
        row = {"batch": batch, "output_tokens": tokens, "seconds": seconds,
               "tok_per_s": round(tokens / statistics.median(seconds), 1)}
        results.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"drafts": args.drafts, "max_tokens": args.max_tokens, "rounds": args.rounds,
                                          "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
