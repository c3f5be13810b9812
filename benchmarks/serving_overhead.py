"""What serving adds to each output token: served TPOT at concurrency 1 minus the offline engine's time per token.

    python benchmarks/serving_overhead.py [--before /tmp/tokenmill-before] [--out benchmarks/results/serving-overhead.json]

For each tokenmill checkout (this one, and ``--before``: an earlier checkout, ``git worktree add DIR COMMIT``), in one
run, alternating checkouts for ``--rounds`` rounds, in reverse order every other round (this machine's speed drifts
by 10-20% between minutes, so every figure is a median over rounds):
- offline: the engine in-process (``LLM.generate``) on random 256-token prompts; time per output token =
  (time for 64 tokens - time for 1 token) / 63, median over the prompts;
- served: ``tokenmill serve`` with the same defaults, ``tokenmill bench`` at concurrency 1 (``--requests`` requests of
  256 in / 64 out, streaming); TPOT p50 and mean.
Overhead = served TPOT p50 - offline time per token, per round (the goal: under 1 ms); reported as the median.
This machine drifts too much between minutes for that difference alone, so where the server reports its engine's
decode steps (``tokenmill:engine_decode_step_seconds_total`` / ``engine_decode_steps_total``) the served run also
gives the in-run figure: served TPOT mean - mean decode step, both measured over the same requests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokenmill.bench.loadgen import scrape_metrics
from tokenmill.bench.sweep import DEFAULTS, run_sweep

ROOT = Path(__file__).resolve().parent.parent

OFFLINE = """
import json, statistics, sys, time
import torch
from tokenmill import LLM, SamplingParams
llm = LLM()
gen = torch.Generator().manual_seed(0)
prompts = torch.randint(100, 49152, (int(sys.argv[1]), 256), generator=gen).tolist()
def timed(prompt, n):
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - start
timed(prompts[0], 4)  # warm-up
per_token = [(timed(p, 64) - timed(p, 1)) / 63 for p in prompts]
print(json.dumps({"per_token_s": per_token, "median_s": statistics.median(per_token)}))
"""


def offline(pythonpath: str | None, num_prompts: int) -> dict:
    env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    # The working directory comes first on sys.path: run where the measured checkout's tokenmill is found first.
    out = subprocess.run([sys.executable, "-c", OFFLINE, str(num_prompts)], env=env, capture_output=True, text=True,
                         check=True, cwd=pythonpath or ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def served(pythonpath: str | None, port: int, work: Path, requests: int) -> dict:
    env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    log = open(work / f"serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=pythonpath or ROOT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        settings = {**DEFAULTS, "base_url": f"http://127.0.0.1:{port}/v1", "concurrency": "1", "input_len": 256,
                    "output_len": 64, "num_prompts": requests, "warmup": 1, "vocab_size": 49152, "seed": 1,
                    "model": httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]}
        before = scrape_metrics(settings["base_url"]) or {}
        level = run_sweep(settings)["levels"][0]
        after = scrape_metrics(settings["base_url"]) or {}
        assert not sum(level["errors"].values()), level["errors"]
        result = {"tpot_p50_s": level["tpot_s"]["p50"], "tpot_mean_s": level["tpot_s"]["mean"],
                  "ttft_p50_s": level["ttft_s"]["p50"], "output_tok_per_s": level["output_tok_per_s"]}
        steps = [after.get(k, 0) - before.get(k, 0) for k in (
            "tokenmill:engine_decode_steps_total", "tokenmill:engine_decode_step_seconds_total")]
        if steps[0] > 0:  # includes the warm-up request's steps: the same kind of step
            result["engine_decode_step_mean_s"] = steps[1] / steps[0]
            result["in_run_overhead_per_token_s"] = result["tpot_mean_s"] - result["engine_decode_step_mean_s"]
        return result
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="an earlier tokenmill checkout, measured the same way")
    parser.add_argument("--num-prompts", type=int, default=3, help="offline prompts per round")
    parser.add_argument("--requests", type=int, default=8, help="served requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", default="/tmp/tokenmill-overhead")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving-overhead.json"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    versions = {"after": None, **({"before": args.before} if args.before else {})}
    rounds: dict[str, list[dict]] = {name: [] for name in versions}
    ports = {name: 8021 + i for i, name in enumerate(versions)}
    for r in range(args.rounds):
        # Odd rounds run the checkouts in reverse order (ABBA...): a drift within a round favours neither.
        order = list(versions.items()) if r % 2 == 0 else list(reversed(versions.items()))
        for name, path in order:
            result = {"offline": offline(path, args.num_prompts), "served": served(path, ports[name], work, args.requests)}
            result["overhead_per_token_s"] = result["served"]["tpot_p50_s"] - result["offline"]["median_s"]
            rounds[name].append(result)
            in_run = result["served"].get("in_run_overhead_per_token_s")
            print(f"round {r} {name}: offline {result['offline']['median_s'] * 1e3:.1f} ms/token, served TPOT p50 "
                  f"{result['served']['tpot_p50_s'] * 1e3:.1f} ms -> overhead "
                  f"{result['overhead_per_token_s'] * 1e3:.1f} ms/token"
                  + (f"; in-run: TPOT mean - engine decode step = {in_run * 1e3:.2f} ms" if in_run is not None else ""),
                  flush=True)
    results = {}
    for name, runs in rounds.items():
        results[name] = {"rounds": runs, "median": {
            "offline_per_token_s": statistics.median(x["offline"]["median_s"] for x in runs),
            "served_tpot_p50_s": statistics.median(x["served"]["tpot_p50_s"] for x in runs),
            "overhead_per_token_s": statistics.median(x["overhead_per_token_s"] for x in runs)}}
        in_run = [x["served"]["in_run_overhead_per_token_s"] for x in runs if "in_run_overhead_per_token_s" in x["served"]]
        if in_run:
            results[name]["median"]["in_run_overhead_per_token_s"] = statistics.median(in_run)
        m = results[name]["median"]
        print(f"{name}: median over {len(runs)} rounds: offline {m['offline_per_token_s'] * 1e3:.1f} ms/token, "
              f"served {m['served_tpot_p50_s'] * 1e3:.1f} ms, overhead {m['overhead_per_token_s'] * 1e3:.1f} ms/token")
    record = {"command": " ".join(["python benchmarks/serving_overhead.py", *argv]),
              "date": time.strftime("%Y-%m-%d"), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
