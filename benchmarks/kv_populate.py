"""What populating the CPU KV cache buys: each mode of ``kv_cache_populate`` in a fresh engine process (a fresh
cache, as a server start gets), in alternating order, timing start-up and then ``--requests`` random prompts of
``--prompt-len`` tokens, ``--output-len`` forced outputs each, ``--concurrency`` at a time (the engine's
max_num_seqs), on the offline engine after one short warm-up request.

    python benchmarks/kv_populate.py [--modes lazy,startup] [--rounds 2] [--concurrency 32]
        [--requests 128] [--out benchmarks/results/kv-populate.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, random, sys, time
from tokenmill import LLM, SamplingParams
mode, seqs, n, prompt_len, output_len = sys.argv[1], *map(int, sys.argv[2:6])
start = time.perf_counter()
llm = LLM(kv_cache_populate=mode, max_num_seqs=seqs)
ready = time.perf_counter() - start
rng = random.Random(time.time_ns())
prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(n)]
llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
start = time.perf_counter()
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
seconds = time.perf_counter() - start
print(json.dumps({"mode": mode, "ready_seconds": ready, "seconds": seconds, "output_tok_s": n * output_len / seconds}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="lazy,startup")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/kv-populate.json")
    args = parser.parse_args(argv)
    runs = []
    for round_ in range(args.rounds):
        for mode in args.modes.split(","):
            done = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.concurrency), str(args.requests),
                                   str(args.prompt_len), str(args.output_len)],
                                  capture_output=True, text=True, check=True)
            run = {"round": round_ + 1, **json.loads(done.stdout.strip().splitlines()[-1])}
            runs.append(run)
            print(f"round {run['round']} {mode:>10}: ready in {run['ready_seconds']:.1f} s, "
                  f"{run['output_tok_s']:.1f} output tok/s ({run['seconds']:.1f} s)", flush=True)
    result = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "processor": _cpu_name(),
              "concurrency": args.concurrency, "requests": args.requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
