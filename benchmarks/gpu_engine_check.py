"""The engine end to end on a GPU (benchmarks/gpu_check.sh runs it; issue 12, item 5).

Two random checkpoints written here by transformers -- a Llama with SmolLM2-135M's shapes (the real weights do not
travel to the GPU machine; the shapes are what matter for speed) and a tiny DeepSeek-V3 (MLA + MoE) -- each served:
1. on the CPU with the PyTorch references, fp32 (the reference path);
2. on CUDA with the Triton kernels, fp32 weights and KV cache, eagerly (``enforce_eager``);
3. on CUDA with CUDA-graph decode (the default).
Checks: greedy tokens of 2 equal 1 (``tokens_cuda_vs_cpu``: exact; TF32 in Triton's fp32 dots can flip a near-tie,
so the first divergence and the logits' largest difference are reported too), and 3 equal 2 (``graphs_vs_eager``:
the same kernels, so exactly). Also the decode speed of 2 and 3 at batch 1 and 16 (bf16, the GPU default).

    python benchmarks/gpu_engine_check.py --out engine.json [--tokenizer DIR]
    TRITON_INTERPRET=1 python benchmarks/gpu_engine_check.py --smoke   # on a CPU: the script's own plumbing
``--tokenizer``: a directory with SmolLM2's tokenizer files (gpu_wheels.sh saves one to .gpu/tokenizer); default:
the embedded model's. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)
PROMPTS = [[(7 * i + j) % 4000 + 100 for i in range(n)] for j, n in enumerate((5, 37, 130, 300))]


def write_checkpoints(root: Path, tokenizer_dir: str | None, smoke: bool) -> dict[str, Path]:
    import transformers

    from tokenmill.models.tokenizer import Tokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir \
        else Tokenizer.of_model(None).hf
    torch.manual_seed(0)
    llama = dict(SMOLLM2_SHAPES, num_hidden_layers=2) if smoke else SMOLLM2_SHAPES
    models = {"smollm2-shaped": transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)),
              "tiny-deepseek-v3": transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
                  vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                  kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                  norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False))}
    paths = {}
    for name, model in models.items():
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" not in pname and "deepseek" in name:
                    p.normal_(0, 0.08)
        paths[name] = root / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def greedy(path: Path, prompts, max_tokens: int, warm: bool = False, **config) -> tuple[list[list[int]], float, int]:
    """Greedy tokens, seconds (after a one-token warm-up request where ``warm``), and the decode steps that replayed
    a CUDA graph. Each LLM's KV cache is bounded by kv_cache_memory; the LLM is closed before returning."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=str(path), kv_cache_memory="256MiB", max_model_len=1024, **config)
    try:
        if warm:  # the kernels' first launches compile
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        start = time.perf_counter()
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - start
        graphs = llm.engine.runner.graphs
        return [r.token_ids for r in out], seconds, graphs.num_runs if graphs else 0
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def first_divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]


def decode_speed(path: Path, batch: int, device: str, eager: bool, tokens: int) -> float:
    """Output tokens/s of ``batch`` greedy requests decoding ``tokens`` tokens each (bf16)."""
    prompts = [[100 + i] * 16 for i in range(batch)]
    _, seconds, _ = greedy(path, prompts, tokens, warm=True, device=device, dtype="bfloat16", enforce_eager=eager)
    return batch * tokens / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-engine.json")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU only: both 'devices' are the CPU, 2 layers")
    args = parser.parse_args()
    gpu = "cpu" if args.smoke else "cuda"
    if gpu == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here (use --smoke on a CPU)")
        return 1
    report = {"command": " ".join(["python benchmarks/gpu_engine_check.py", *sys.argv[1:]]),
              "device": torch.cuda.get_device_name() if gpu == "cuda" else "CPU (smoke)", "models": {}}
    ok = True
    max_tokens, prompts = (4, PROMPTS[:2]) if args.smoke else (32, PROMPTS)
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in write_checkpoints(Path(tmp), args.tokenizer, args.smoke).items():
            fp32 = dict(dtype="float32", kv_cache_dtype="fp32")
            cpu, _, _ = greedy(path, prompts, max_tokens, device="cpu", kernel_backend="torch", enforce_eager=True,
                               **fp32)
            eager, _, _ = greedy(path, prompts, max_tokens, device=gpu, kernel_backend="triton", enforce_eager=True,
                                 **fp32)
            graphs, _, graph_steps = greedy(path, prompts, max_tokens, device=gpu, kernel_backend="triton", **fp32)
            result = {"tokens_cuda_vs_cpu": eager == cpu, "first_divergence_cuda_vs_cpu": first_divergence(eager, cpu),
                      "graphs_vs_eager": graphs == eager,
                      "graph_steps": graph_steps}
            if not args.smoke:
                result["decode_tok_s"] = {f"batch {b} {mode}": decode_speed(path, b, gpu, mode == "eager", 64)
                                          for b in (1, 16) for mode in ("eager", "graphs")}
            if gpu == "cuda":  # what closed engines left allocated (a leak would starve the next engine)
                result["cuda_mib_allocated_after_close"] = torch.cuda.memory_allocated() / 2**20
            ok &= result["tokens_cuda_vs_cpu"] and result["graphs_vs_eager"]
            report["models"][name] = result
            print(name, json.dumps(result), flush=True)
    report["passed"] = ok
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
