"""What grammar masking costs: one `tokenmill serve` (SmolLM2, default settings), the same chat requests with and
without a JSON schema, alternated round by round at each concurrency, so both see the same machine.

Each request asks for a list: unconstrained ones get ``--max-tokens`` tokens (ignore_eos), constrained ones a schema
whose array of strings SmolLM2 keeps extending until the engine, near max_tokens, steers it to close the document
(so they end a few tokens early, with finish_reason stop; counted as they are, and reported). Output tokens/s = all
completion tokens / wall time of the level; TPOT (the per-token cost, the fairer comparison) from the stream.

    python benchmarks/structured.py                       # concurrency 1 and 16, 2 rounds
Writes benchmarks/results/structured-outputs.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from compare_cpu import cpu_name, wait_ready  # benchmarks/ is sys.path[0] when a script here runs

ROOT = Path(__file__).resolve().parent.parent
PORT = 8012
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
          "required": ["items"], "additionalProperties": False}
TOPICS = ["fruits", "rivers", "capital cities", "colors", "animals", "programming languages", "tools", "planets"]


async def one(client: httpx.AsyncClient, model: str, index: int, constrained: bool, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"List {TOPICS[index % len(TOPICS)]} as JSON (request {index})."}]}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    times, usage, finish = [], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    times.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
    tokens = usage["completion_tokens"]
    tpot = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
    return {"tokens": tokens, "tpot_s": tpot, "finish_reason": finish}


async def level(base_url: str, model: str, concurrency: int, constrained: bool, args) -> dict:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def run(i: int) -> dict:
            async with sem:
                return await one(client, model, i, constrained, args.max_tokens)
        start = time.perf_counter()
        results = await asyncio.gather(*[run(i) for i in range(args.requests_per_slot * concurrency)])
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    tpots = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    return {"concurrency": concurrency, "schema": constrained, "requests": len(results),
            "errors": len(results) - len(ok), "output_tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
            "output_tok_per_s": sum(r["tokens"] for r in ok) / wall,
            "tpot_p50_ms": statistics.median(tpots) * 1e3 if tpots else None,
            "ended_early": sum(r["finish_reason"] != "length" for r in ok)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "structured-outputs.json"))
    args = parser.parse_args()
    log = open("/tmp/tokenmill-structured-bench.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(PORT)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    base_url = f"http://127.0.0.1:{PORT}"
    levels = []
    try:
        wait_ready(base_url + "/v1/models", proc, 900)
        model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(level(base_url, model, 2, True, args))  # warm-up: compile paths, grammar cache
        for round_index in range(args.rounds):
            for c in (int(x) for x in args.concurrency.split(",")):
                for constrained in (False, True):
                    print(f"round {round_index}: concurrency {c}, schema {constrained}", file=sys.stderr)
                    levels.append({**asyncio.run(level(base_url, model, c, constrained, args)),
                                   "round": round_index})
    finally:
        proc.terminate()
        proc.wait(60)
    raw = {"command": f"python benchmarks/structured.py {' '.join(sys.argv[1:])}", "date": time.strftime("%Y-%m-%d"),
           "cpu": cpu_name(), "cores": os.cpu_count(), "levels": levels}
    Path(args.out).write_text(json.dumps(raw, indent=2) + "\n")
    print("| concurrency | round | schema | output tok/s | TPOT p50 ms | ended before max_tokens | errors |")
    print("|---|---|---|---|---|---|---|")
    for lv in sorted(levels, key=lambda lv: (lv["concurrency"], lv["round"], lv["schema"])):
        print(f"| {lv['concurrency']} | {lv['round']} | {'yes' if lv['schema'] else 'no'} | "
              f"{lv['output_tok_per_s']:.1f} | {lv['tpot_p50_ms']:.1f} | {lv['ended_early']} | {lv['errors']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
