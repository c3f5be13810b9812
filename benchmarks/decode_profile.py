"""Where a decode step's time goes: the offline engine (default model) decoding ``--batch`` requests of
``--prompt-len`` random tokens, timed, then profiled with torch.profiler; the top operators by self CPU time go to
JSON. Run it compiled (the default on a CPU) and with ``--enforce-eager`` to see what compilation changed.

    python benchmarks/decode_profile.py --batch 1,16 [--enforce-eager] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams


def steady_decode(llm: LLM, batch: int, prompt_len: int) -> None:
    """Admit ``batch`` requests and step until every prompt is in the cache (each next step is a pure decode)."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True)
    for _ in range(batch):
        llm.add_request([rng.randrange(1000, 40000) for _ in range(prompt_len)], params)
    running = llm.engine.scheduler.running
    while len(running) < batch or any(r.num_computed_tokens < r.num_prompt_tokens for r in running):
        llm.engine.step()
    llm.engine.step()


def step_ms(llm: LLM, rounds: int = 6, steps: int = 4) -> tuple[float, float]:
    """(best, median) milliseconds per step over ``rounds`` rounds of ``steps`` steps."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        times.append((time.perf_counter() - start) / steps * 1e3)
    times.sort()
    return times[0], times[len(times) // 2]


def profile(llm: LLM, steps: int, top: int) -> list[dict]:
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            llm.engine.step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
            for e in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--quantization", default="auto", help="auto | none | int8 | int4 | fp8")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/decode-profile-<mode>.json")
    args = parser.parse_args()
    mode = "eager" if args.enforce_eager else "compiled"
    results = []
    for batch in (int(b) for b in args.batch.split(",")):
        llm = LLM(enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype, num_threads=args.num_threads,
                  max_num_seqs=max(batch, 1), kv_cache_memory="1GiB", quantization=args.quantization)
        steady_decode(llm, batch, args.prompt_len)
        best, median = step_ms(llm)
        ops = profile(llm, args.profile_steps, args.top)
        results.append({"batch": batch, "step_ms_best": best, "step_ms_median": median, "top_ops": ops})
        print(f"batch {batch}: step {best:.1f} ms best, {median:.1f} ms median ({mode}, "
              f"{torch.get_num_threads()} threads)")
        for op in ops:
            print(f"  {op['self_ms_per_step']:8.2f} ms  {op['calls_per_step']:6.0f} calls  {op['op']}")
        del llm
    out = Path(args.out or f"benchmarks/results/decode-profile-{mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/decode_profile.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
        for k, v in vars(args).items() if v not in (None, False) and k != "out")
    out.write_text(json.dumps({"command": command, "torch": torch.__version__, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
