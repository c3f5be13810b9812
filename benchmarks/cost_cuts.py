"""A cost cut before and after, in one run: the same `tokenmill serve` (SmolLM2, default settings otherwise) started
without the feature ("off") and with it ("on"), one at a time, each swept with the same loads by `tokenmill bench`.

--feature prefix-caching (--no-enable-prefix-caching vs default):
  shared-prefix  every prompt = one shared --prefix-len-token prefix (a system prompt) + its own question,
                 --input-len tokens in all, --output-len forced; TTFT, throughput, cost per 1M tokens;
  random         fresh random prompts (nothing to share): what hashing and lookups cost when nothing hits.
--feature ngram (default vs --speculative-method ngram):
  copy           chat requests that repeat, proofread or quote a passage (tokenmill bench --dataset copy);
  random         random token prompts, where drafts rarely match: speculation must not cost throughput.

Writes the raw JSON (--out, default benchmarks/results/<feature>.json) and prints a Markdown table.

    python benchmarks/cost_cuts.py --feature prefix-caching
    python benchmarks/cost_cuts.py --feature ngram
    python benchmarks/cost_cuts.py --feature prefix-caching --only random --rounds 3   # off, on, off, on, ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from compare_cpu import cpu_name, wait_ready  # benchmarks/ is sys.path[0] when a script here runs
from tokenmill.bench.sweep import DEFAULTS, run_sweep

ROOT = Path(__file__).resolve().parent.parent
PORT = 8011
FLAGS = {"prefix-caching": (["--no-enable-prefix-caching"], ["--enable-prefix-caching"]),
         "ngram": ([], ["--speculative-method", "ngram"])}


def loads(args) -> dict[str, dict]:
    common = {**DEFAULTS, "base_url": f"http://127.0.0.1:{PORT}/v1", "vocab_size": 49152, "warmup": 1,
              "hourly_cost": args.hourly_cost}
    rand = {**common, "input_len": 256, "output_len": 64, "concurrency": args.random_concurrency,
            "temperature": args.random_temperature}
    if args.feature == "prefix-caching":
        found = {"shared-prefix": {**common, "dataset": "shared-prefix", "prefix_len": args.prefix_len,
                                   "input_len": args.input_len, "output_len": 32, "concurrency": args.concurrency},
                 "random": rand}
    else:
        found = {"copy": {**common, "dataset": "copy", "endpoint": "chat", "input_len": 0, "output_len": 96,
                          "concurrency": args.concurrency}, "random": rand}
    return {name: load for name, load in found.items() if args.only in (None, name)}


def sweep(flags: list[str], args, round_index: int) -> dict[str, list[dict]]:
    name = "on" if flags == FLAGS[args.feature][1] else "off"
    log = open(Path(args.work) / f"{args.feature}-{name}-{round_index}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(PORT), *flags], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(f"http://127.0.0.1:{PORT}/v1/models", proc, 900)
        model = httpx.get(f"http://127.0.0.1:{PORT}/v1/models").json()["data"][0]["id"]
        out = {}
        for load, settings in loads(args).items():
            levels = []
            for c in (int(level) for level in str(settings["concurrency"]).split(",")):
                print(f"{args.feature} {name} (round {round_index}), {load}: concurrency {c}", file=sys.stderr)
                for level in run_sweep({**settings, "model": model, "concurrency": str(c),
                                        "num_prompts": max(8, 4 * c), "seed": args.seed + c})["levels"]:
                    levels.append({**level, "round": round_index})
            out[load] = levels
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def table(results: dict[str, dict[str, list[dict]]]) -> str:
    lines = ["| load | feature | concurrency | round | req/s | output tok/s | total tok/s | TTFT p50 / p99 ms | "
             "TPOT p50 ms | prefix hits | drafts accepted | $/M total tokens | errors |", "|---" * 13 + "|"]
    for load in results["off"]:
        for name in ("off", "on"):
            for lv in sorted(results[name][load], key=lambda lv: (lv["concurrency"], lv["round"])):
                server = lv.get("server") or {}
                hit, accepted = server.get("prefix_cache_hit_rate"), server.get("spec_acceptance_rate")
                cost = lv.get("usd_per_million_total_tokens")
                lines.append(
                    f"| {load} | {name} | {lv['concurrency']} | {lv['round']} | {lv['request_throughput']:.3f} | "
                    f"{lv['output_tok_per_s']:.1f} | {lv['total_tok_per_s']:.1f} | {lv['ttft_s']['p50'] * 1e3:.0f} / "
                    f"{lv['ttft_s']['p99'] * 1e3:.0f} | {(lv['tpot_s']['p50'] or 0) * 1e3:.1f} | "
                    f"{'-' if hit is None else f'{hit:.0%}'} | {'-' if accepted is None else f'{accepted:.0%}'} | "
                    f"{'-' if cost is None else f'{cost:.3f}'} | {sum(lv['errors'].values())} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--feature", choices=sorted(FLAGS), required=True)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--random-concurrency", default="1,16")
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1100)
    parser.add_argument("--hourly-cost", type=float, default=0.10, help="USD per hour of the machine (cost column)")
    parser.add_argument("--only", help="run one load only (e.g. random)")
    parser.add_argument("--random-temperature", type=float, default=0.0,
                        help="of the random load (greedy SmolLM2 repeats itself on random prompts: drafts match)")
    parser.add_argument("--rounds", type=int, default=1, help="off, on, off, on, ...: servers alternate")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--work", default="/tmp/tokenmill-cost-cuts")
    parser.add_argument("--out", help="raw JSON (default benchmarks/results/<feature>.json)")
    args = parser.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[dict]]] = {"off": {}, "on": {}}
    for round_index in range(args.rounds):
        for name, flags in zip(("off", "on"), FLAGS[args.feature]):
            for load, levels in sweep(flags, args, round_index).items():
                results[name].setdefault(load, []).extend(levels)
    raw = {"command": f"python benchmarks/cost_cuts.py {' '.join(sys.argv[1:])}", "date": time.strftime("%Y-%m-%d"),
           "cpu": cpu_name(), "cores": os.cpu_count(), "results": results}
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{args.feature}.json")
    out.write_text(json.dumps(raw, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
