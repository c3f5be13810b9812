"""An MoE model at a real model's shapes served three ways, one server at a time, on the same load: eager
(``--enforce-eager``), compiled with the routed experts as one opaque op (the default, kernels/moe_op.py), and
compiled with the experts left out of the graph by graph breaks (``torch._dynamo.disable`` around them, the graph not
``fullgraph``: the other way to move the data-dependent part out of the traced graph, patched in through this
directory's ``graph_breaks`` start-up hook; never shipped).

The checkpoint: transformers' Qwen3-MoE at Qwen3-30B-A3B's shapes (hidden 2048, 32 query / 4 KV heads of 128, 128
experts of width 768, 8 per token, vocabulary 151,936) with ``--layers`` of its 48 layers, random weights
(``from_config``: speed depends on shapes, not values), saved in bfloat16. Every other setting is the default (the
engine settles dtype, threads, layouts by its own measurements), except ``--max-model-len`` (the default 2 GiB KV
cache holds the load either way).

Load: ``tokenmill bench``'s sweep, random prompts of ``--input-len`` tokens and ``--output-len`` output tokens, at each
concurrency of ``--concurrency`` (``--waves`` x the concurrency requests, at least ``--min-prompts``); fresh prompts per
server (no warm prefix cache). A decode-bound load: short prompts, long outputs, one wave. Writes the raw JSON to ``--out``.

``--steps``: instead of serving, the decode step itself, in one offline engine (default settings, compiled) holding
1 and then 16 running requests of ``--input-len`` prompt tokens: ``--rounds`` rounds of ``--steps-per-round`` pure
decode steps with the compiled graph, then as many with the same model eagerly (its ``compiled_decoder`` set aside),
the order alternating round by round; same weights, cache and requests, so only the execution differs.

    python benchmarks/moe_execution.py [--layers 4] [--concurrency 1,16] [--out benchmarks/results/moe-execution.json]
    python benchmarks/moe_execution.py --steps [--layers 4] [--rounds 6] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokenmill.bench.sweep import DEFAULTS, run_sweep

HERE = Path(__file__).resolve().parent
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
VARIANTS = {
    "eager": (["--enforce-eager"], {}),
    "compiled-opaque-op": ([], {}),
    "compiled-graph-breaks": ([], {"PYTHONPATH": str(HERE / "graph_breaks"), "TOKENMILL_MOE_GRAPH_BREAKS": "1"}),
}


def make_checkpoint(path: Path, layers: int) -> Path:
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    from tokenmill.models.paths import default_model_path
    from tokenmill.models.tokenizer import Tokenizer

    config = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B, num_hidden_layers=layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # never a float32 copy
    model.save_pretrained(path)
    Tokenizer.of_model(str(default_model_path()), None).hf.save_pretrained(path)  # SmolLM2's: ids < 49152
    return path


def serve(args, checkpoint: Path, name: str) -> list[dict]:
    flags, env = VARIANTS[name]
    port = 8790
    log_path = Path(args.work) / f"{name}.log"
    env = {**{k: v for k, v in os.environ.items() if k != "TOKENMILL_ENFORCE_EAGER"}, **env}
    if "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    cmd = [sys.executable, "-m", "tokenmill", "serve", str(checkpoint), "--port", str(port), "--max-model-len",
           str(args.input_len + args.output_len + 64), *flags]
    process = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name}: the server exited ({log_path})")
            try:
                if httpx.get(base.removesuffix("/v1") + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: not ready in {args.startup_timeout} s ({log_path})")
            time.sleep(2)
        levels = []
        for level in (int(c) for c in args.concurrency.split(",")):
            settings = {**DEFAULTS, "base_url": base, "model": checkpoint.name, "concurrency": str(level),
                        "input_len": args.input_len, "output_len": args.output_len,
                        "num_prompts": max(args.min_prompts, args.waves * level), "warmup": 1, "vocab_size": 49152,
                        "seed": time.time_ns() % 2**31}
            print(f"{name}: concurrency {level}", file=sys.stderr, flush=True)
            levels += run_sweep(settings)["levels"]
        log = log_path.read_text()
        return [{"variant": name, "settled": _settled(log), **level} for level in levels]
    finally:
        process.terminate()
        process.wait(120)


def _settled(log: str) -> dict:
    """What the server's log says it settled and how it runs."""
    found = {}
    if m := re.search(r"settled: device=\w+, dtype=(\w+), num_threads=(\d+)", log):
        found.update(dtype=m.group(1), threads=int(m.group(2)))
    if m := re.search(r"engine ready: .* execution=(\w+)", log):
        found["execution"] = m.group(1)
    if m := re.search(r"compiled the layer stack in ([\d.]+) s", log):
        found["compile_s"] = float(m.group(1))
    return found


def decode_steps(args, checkpoint: Path) -> list[dict]:
    import statistics

    from decode_profile import steady_decode

    from tokenmill import LLM

    llm = LLM(model=str(checkpoint), enforce_eager=False, kv_cache_memory="1GiB",
              max_model_len=args.input_len + 1024)
    model = llm.engine.runner.model
    compiled = model.compiled_decoder
    assert compiled is not None, "the model did not compile"
    results = []
    for batch in (int(c) for c in args.concurrency.split(",")):
        steady_decode(llm, batch, args.input_len)
        times: dict[str, list[float]] = {"compiled": [], "eager": []}
        for r in range(args.rounds):
            for name in (("compiled", "eager") if r % 2 == 0 else ("eager", "compiled")):
                model.compiled_decoder = compiled if name == "compiled" else None
                start = time.perf_counter()
                for _ in range(args.steps_per_round):
                    llm.engine.step()
                times[name].append((time.perf_counter() - start) / args.steps_per_round)
        model.compiled_decoder = compiled
        for request in list(llm.engine.scheduler.running) + list(llm.engine.scheduler.waiting):
            llm.engine.abort(request.request_id)
        llm.engine.step()
        for name, seconds in times.items():
            median = statistics.median(seconds)
            results.append({"variant": name, "batch": batch, "step_ms_median": median * 1e3,
                            "step_ms_best": min(seconds) * 1e3, "step_ms_rounds": [t * 1e3 for t in seconds],
                            "decode_tok_per_s": batch / median})
            print(f"{name:9} batch {batch:3}  step {median * 1e3:8.1f} ms (best {min(seconds) * 1e3:.1f})  "
                  f"decode {batch / median:7.2f} tok/s", flush=True)
    return results


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
    return sorted(f for f in (flags.group(1).split() if flags else []) if f in keep)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--waves", type=int, default=2, help="requests per level: this many times the concurrency")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--work", default="/tmp/moe-execution")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--out", default=str(HERE / "results" / "moe-execution.json"))
    parser.add_argument("--steps", action="store_true", help="time decode steps offline instead of serving")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=8)
    args = parser.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    checkpoint = make_checkpoint(Path(args.work) / f"qwen3-30b-a3b-{args.layers}-layers", args.layers)
    if args.steps:
        results = decode_steps(args, checkpoint)
        report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "host": platform.node(),
                  "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "layers": args.layers,
                  "shapes": QWEN3_30B_A3B, "results": results}
        Path(args.out).write_text(json.dumps(report, indent=1))
        return 0
    results = []
    for name in args.variants.split(","):
        results += serve(args, checkpoint, name)
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "host": platform.node(),
              "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "layers": args.layers, "shapes": QWEN3_30B_A3B,
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1))
    for r in results:
        print(f"{r['variant']:24} c={r['concurrency']:<3} output {r['output_tok_per_s']:7.2f} tok/s  "
              f"TPOT p50 {r['tpot_s']['p50'] * 1e3:7.1f} ms  errors {sum(r['errors'].values())}  {r['settled']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
