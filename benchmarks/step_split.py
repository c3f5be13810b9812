"""Where an offline decode step's time goes when the CPU layer stack runs it (its one C call hides the layers from
torch's profiler): the default model decoding ``--batch`` requests of ``--prompt-len`` random tokens, ``--steps``
steps a round timed whole, with the stack's call and the LM head timed inside; the rest is the step's host work
(scheduling, input preparation, sampling, detokenization, outputs), of which detokenization (the requests' incremental
detokenizers) is timed too. ms a step per round, to JSON.

    python benchmarks/step_split.py [--batch 1,32] [--rounds 3] [--steps 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from decode_profile import steady_decode  # noqa: E402

from tokenmill import LLM  # noqa: E402
from tokenmill.engine.detokenizer import IncrementalDetokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/step-split.json")
    args = parser.parse_args()
    llm = LLM(kv_cache_memory="1GiB")
    model = llm.engine.runner.model
    assert model.cpu_stack is not None, "the default model did not take the layer stack"
    inside = {"stack": 0.0, "lm_head": 0.0, "detokenize": 0.0}

    def timed(name, fn):
        def call(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                inside[name] += time.perf_counter() - start
        return call
    model.cpu_stack.run = timed("stack", model.cpu_stack.run)
    model.compute_logits = timed("lm_head", model.compute_logits)
    IncrementalDetokenizer.update = timed("detokenize", IncrementalDetokenizer.update)  # a plain function: a method
    results = []
    for batch in (int(b) for b in args.batch.split(",")):
        steady_decode(llm, batch, args.prompt_len)
        for round_ in range(args.rounds):
            inside.update(stack=0.0, lm_head=0.0, detokenize=0.0)
            start = time.perf_counter()
            for _ in range(args.steps):
                llm.engine.step()
            step = (time.perf_counter() - start) / args.steps * 1e3
            row = {"batch": batch, "round": round_, "step_ms": round(step, 3),
                   "stack_ms": round(inside["stack"] / args.steps * 1e3, 3),
                   "lm_head_ms": round(inside["lm_head"] / args.steps * 1e3, 3),
                   "detokenize_ms": round(inside["detokenize"] / args.steps * 1e3, 3)}
            row["rest_ms"] = round(step - row["stack_ms"] - row["lm_head_ms"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)
        for request_id in list(llm.engine.scheduler.requests):
            llm.engine.abort(request_id)
    Path(args.out).write_text(json.dumps({"command": "python benchmarks/step_split.py " + " ".join(sys.argv[1:]),
                                          "prompt_len": args.prompt_len, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
