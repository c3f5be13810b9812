"""Sequences at 8k context that fit in one KV memory, with sliding-window layers holding only their window
(kvcache/groups.py) against full-length caching of every layer, through the real scheduler and block manager.

For each model shape (a `tokenmill plan` preset: its layers, KV heads, windows), the same KV memory is cut into blocks
of the engine's own layout twice: grouped by attention kind (the engine's layout), and as one group of every layer
(what the engine did before groups: every layer caches every token). Requests of ``--context`` prompt tokens then
run through the real Scheduler and KVCacheManager (a runner that samples token 1 stands in for the model: what fits
is the allocator's business); the figure is the most requests decoding at once, each holding its whole context.

The ideal ratio is what the layer pattern allows: all layers times the context, over the full layers times the
context plus the window layers times their window. The issue asks for at least 90% of it.

    python benchmarks/kv_windows.py > benchmarks/results/kv-windows.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys

from tokenmill.bench.plan import PRESETS, kv_spec
from tokenmill.kvcache.manager import KVCacheManager
from tokenmill.kvcache.spec import KVCacheSpec
from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler.output import OutputReports, RunnerOutput
from tokenmill.scheduler.request import Request
from tokenmill.scheduler.scheduler import Scheduler

GiB = 2**30


def decoding_at_once(spec: KVCacheSpec, memory: int, context: int, new_tokens: int, budget: int) -> dict:
    """Run requests of ``context`` prompt tokens until they all finish; the most that decoded at once."""
    num_blocks = spec.num_blocks_for(memory) - 1  # less the null block
    sched = Scheduler(KVCacheManager(num_blocks, spec.block_size, False, spec.groups), max_num_seqs=4096,
                      max_num_batched_tokens=budget)
    per_sequence = spec.groups.blocks_for(context + new_tokens, spec.block_size)
    num_requests = 2 * num_blocks // per_sequence + 2
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 50000) for _ in range(context)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                                  max_tokens=new_tokens))
    most, steps = 0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        decoding = sum(1 for r in sched.running if r.num_computed_tokens >= context)
        most = max(most, decoding)
        sampled = {rid: [1] for rid, n in out.num_scheduled_tokens.items()
                   if sched.requests[rid].num_computed_tokens + n >= sched.requests[rid].num_tokens}
        sched.update_from_output(out, RunnerOutput(sampled), OutputReports())
        steps += 1
    return {"num_blocks": num_blocks, "blocks_per_sequence": per_sequence, "requests": num_requests,
            "most_decoding_at_once": most, "preemptions": sched.num_preemptions_total, "steps": steps}


def ideal_ratio(spec: KVCacheSpec, context: int) -> float:
    windows = [w for g, w in enumerate(spec.groups.windows) for _ in spec.groups.layers[g]]
    return len(windows) * context / sum(min(w, context) if w else context for w in windows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma-3-27b", "gpt-oss-20b"])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=512,
                        help="outputs per request: more steps than sequences fit, so memory is what bounds them")
    parser.add_argument("--memory", type=float, default=64.0, help="KV memory, GiB")
    parser.add_argument("--kv-dtype", default="bf16")
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    args = parser.parse_args(argv)
    results = []
    for name in args.models:
        grouped = kv_spec(PRESETS[name], args.kv_dtype)
        full = dataclasses.replace(grouped, groups=None)  # one group of every layer: full-length caching
        run = dict(context=args.context, new_tokens=args.new_tokens, budget=args.budget, memory=int(args.memory * GiB))
        windowed, baseline = decoding_at_once(grouped, **run), decoding_at_once(full, **run)
        ratio = windowed["most_decoding_at_once"] / baseline["most_decoding_at_once"]
        ideal = ideal_ratio(grouped, args.context)
        results.append({
            "model": name, "kv_dtype": args.kv_dtype, "kv_memory_gib": args.memory, "context": args.context,
            "groups": {"num_groups": grouped.groups.num_groups, "layers_per_group": grouped.groups.group_size,
                       "windows": list(grouped.groups.windows)},
            "windowed": windowed, "full_length": baseline, "ratio": round(ratio, 3), "ideal_ratio": round(ideal, 3),
            "of_ideal": round(ratio / ideal, 3)})
        print(f"{name}: {windowed['most_decoding_at_once']} vs {baseline['most_decoding_at_once']} sequences "
              f"= {ratio:.2f}x (ideal {ideal:.2f}x, {ratio / ideal:.0%})", file=sys.stderr)
    json.dump({"command": "python benchmarks/kv_windows.py " + " ".join(argv or sys.argv[1:]), "results": results},
              sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
