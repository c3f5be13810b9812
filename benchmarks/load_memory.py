"""Host memory while loading: peak resident memory of each rank against the bytes of that rank's weights.

Writes a random Llama checkpoint (transformers, bf16 safetensors; ~190M parameters, untied 32k vocabulary) to a
temporary directory, then loads it with ``LLM(dtype="float32")`` at --tensor-parallel-size 1 and 2, each in a fresh
process. For every rank: its peak RSS (VmHWM) less its RSS before loading (torch and tokenmill imported), its
parameters' bytes, and the largest single tensor it reads. Loading holds one tensor at a time, so the growth should be
about the rank's weights plus one tensor -- not the whole model, and not a float32 copy of it.
Memory is sampled every 5 ms from /proc: anonymous (what the process allocated) and file-backed (the safetensors file,
memory-mapped: page cache the kernel can drop, counted in RSS while mapped) separately.

    python benchmarks/load_memory.py
Writes benchmarks/results/load-memory.json and prints a Markdown table.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 2 ** 20

PROBE = r"""
import json, sys, threading, time
import torch, tokenmill
from tokenmill import LLM

def status(pid):
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}

peaks, pids, done = {}, {"self": 0}, threading.Event()
def sample():  # every 5 ms: each process's anonymous and file-backed resident memory, peak of each
    while not done.is_set():
        for pid, rank in list(pids.items()):
            try:
                now = status(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
            peak = peaks.setdefault(rank, {"RssAnon": 0, "RssFile": 0})
            for k, v in now.items():
                peak[k] = max(peak[k], v)
        time.sleep(0.005)

before = status("self")
threading.Thread(target=sample, daemon=True).start()
import tokenmill.engine.ranks as ranks_module
spawn = ranks_module.subprocess.Popen
def tracked(cmd, *args, **kwargs):  # sample the worker ranks too, from their start
    proc = spawn(cmd, *args, **kwargs)
    if "tokenmill.engine.ranks" in cmd:
        pids[proc.pid] = int(cmd[3])  # [python, -m, tokenmill.engine.ranks, rank, ...]
    return proc
ranks_module.subprocess.Popen = tracked
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB", num_threads=1,
          enforce_eager=True, tensor_parallel_size=int(sys.argv[2]))
done.set()
params = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
llm.close()
print("RESULT " + json.dumps({"before": before, "peaks": peaks, "rank0_param_bytes": params}))
"""


def write_checkpoint(path: Path) -> dict:
    import torch
    import transformers

    from tokenmill import LLM

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    LLM(kv_cache_memory="8MiB", enforce_eager=True).tokenizer.hf.save_pretrained(path)  # SmolLM2's tokenizer
    largest = max(p.numel() for p in model.parameters())
    return {"parameters": sum(p.numel() for p in model.parameters()), "largest_tensor_fp32_bytes": largest * 4,
            "file_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors"))}


def main() -> None:
    results = {"command": "python benchmarks/load_memory.py", "levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        results["checkpoint"] = write_checkpoint(Path(tmp))
        for tp in (1, 2):
            out = subprocess.run([sys.executable, "-c", PROBE, tmp, str(tp)], capture_output=True, text=True,
                                 cwd=ROOT, check=True).stdout
            level = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            results["levels"].append({"tensor_parallel_size": tp, **level})
    (ROOT / "benchmarks/results/load-memory.json").write_text(json.dumps(results, indent=2) + "\n")
    ck = results["checkpoint"]
    print(f"checkpoint: {ck['parameters'] / 1e6:.0f}M parameters, {ck['file_bytes'] / MiB:.0f} MiB bf16 on disk, "
          f"largest tensor {ck['largest_tensor_fp32_bytes'] / MiB:.0f} MiB in float32\n")
    print("| TP | rank | its weights (float32) | peak anonymous memory while loading | above its weights | "
          "peak file-backed (the mmapped checkpoint) |")
    print("|---|---|---|---|---|---|")
    for level in results["levels"]:
        tp, before = level["tensor_parallel_size"], level["before"]
        for rank, peak in sorted(level["peaks"].items(), key=lambda kv: int(kv[0])):
            weights = level["rank0_param_bytes"]  # ranks hold equal shards
            anon = peak["RssAnon"] - before["RssAnon"]  # workers start from the same imports as rank 0
            cells = [str(tp), rank, f"{weights / MiB:.0f} MiB", f"{anon / MiB:.0f} MiB",
                     f"{(anon - weights) / MiB:.0f} MiB", f"{peak['RssFile'] / MiB:.0f} MiB"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
