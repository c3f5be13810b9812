"""The CPU layer stack in one C call (models/cpu_stack.py) against the same engine without it, in one process.

Two offline engines of the default model, ``cpu_layer_stack`` on and off (the rest as settled: compiled, C kernels),
each holding ``--batch`` running requests of ``--prompt-len`` random tokens; timed in alternating rounds:
- decode: ``--steps`` pure decode steps (ms a step, best and median of the rounds);
- mixed: one step that carries a fresh prompt's first chunk beside the decodes (the steps under load that admit a
  request), ms (best and median); with ``--shared-prefix N``, every fresh prompt is one N-token prefix, cached
  beforehand (a system prompt), then ``--prompt-len`` tokens of its own: a chunk over a cached prefix.
The engines take turns, so both see the same host; each one's contexts grow alike.

    python benchmarks/layer_stack.py [--batch 1,4,16,32] [--prompt-len 256] [--shared-prefix 0] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from decode_profile import steady_decode, step_ms

from tokenmill import LLM, SamplingParams


def mixed_ms(llm: LLM, prompt_len: int, rng: random.Random, prefix: list[int]) -> float:
    """One step with a fresh prompt (``prefix`` + ``prompt_len`` random tokens) admitted beside the running decodes;
    the prompt is then aborted."""
    request = llm.add_request(prefix + [rng.randrange(1000, 40000) for _ in range(prompt_len)],
                              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    llm.engine.step()
    elapsed = (time.perf_counter() - start) * 1e3
    llm.engine.abort(request)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,4,16,32")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens of a cached prefix before each mixed "
                        "step's prompt (a multiple of the cache's block size, so that all of it is a hit)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/layer-stack.json")
    args = parser.parse_args()
    engines = {name: LLM(cpu_layer_stack=name == "stack", kv_cache_memory="1GiB") for name in ("stack", "graph")}
    assert engines["stack"].engine.runner.model.cpu_stack is not None, "the default model did not take the stack"
    # steady_decode draws its prompts from Random(0): the fresh prompts of the mixed steps must not share them (a
    # cached prompt would make its step a short one)
    rng, results = random.Random(1), []
    prefix = [random.Random(2).randrange(1000, 40000) for _ in range(args.shared_prefix)]
    if prefix:  # into each engine's prefix cache
        for llm in engines.values():
            llm.generate([prefix + [1000]], SamplingParams(temperature=0, max_tokens=1))
    for batch in (int(b) for b in args.batch.split(",")):
        for llm in engines.values():
            steady_decode(llm, batch, args.prompt_len)
        times = {name: {"decode": [], "mixed": []} for name in engines}
        for round_ in range(args.rounds):
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:
                times[name]["decode"].append(step_ms(engines[name], rounds=1, steps=args.steps)[0])
                times[name]["mixed"].append(mixed_ms(engines[name], args.prompt_len, rng, prefix))
        row = {"batch": batch}
        for name, kinds in times.items():
            for kind, values in kinds.items():
                row[f"{name}_{kind}_best_ms"] = round(min(values), 2)
                row[f"{name}_{kind}_median_ms"] = round(statistics.median(values), 2)
        for kind in ("decode", "mixed"):
            row[f"{kind}_speedup_median"] = round(row[f"graph_{kind}_median_ms"] / row[f"stack_{kind}_median_ms"], 3)
        results.append(row)
        print(json.dumps(row), flush=True)
        for llm in engines.values():
            for request_id in list(llm.engine.scheduler.requests):
                llm.engine.abort(request_id)
    Path(args.out).write_text(json.dumps({"prompt_len": args.prompt_len, "shared_prefix": args.shared_prefix,
                                          "rounds": args.rounds, "steps": args.steps, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
