"""Time to first token of one long prompt on the offline engine, and where the prefill's time goes.

    python benchmarks/prefill.py [--prompt-len 2000] [--batch 1] [--repeats 3] [--dtype auto] [--settings sdpa,amx]
        [--cpu-layer-stack] [--out benchmarks/results/prefill.json]

For each setting of the prefill attention (``sdpa``: PyTorch's flash SDPA over the own tokens; ``amx`` / ``avx512``:
kernels/cpu/prefill_attention.c on AMX tiles / AVX512-BF16 registers, where the host has them and the model is bf16;
``paged``: the cache kernel
with each chunk a causal segment, a bf16 model over a bf16 cache; ``math``: SDPA forced onto its unfused fallback,
what tokenmill ran before flash) it times ``repeats`` prefills of ``--batch`` random prompts of exactly
``--prompt-len`` tokens each, in one step where the token budget allows (one output token, so the time is the
prefill plus one sample) on the default model, in one run, alternating the settings, then takes one torch profile
per setting: the seconds in attention (the engine's attention op, inclusive) and in matrix products. Writes JSON
(the raw timings and profile totals) to ``--out``.

The engine runs without the CPU layer stack (models/cpu_stack.py) unless ``--cpu-layer-stack``: the stack takes the
C own-token kernels' steps and not SDPA's, so the settings would differ by more than their attention, and its one C
call a step hides attention and GEMMs from the profiler (the profile columns are then 0).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_attention import set_prefill_kernel

# setting -> (own-token kernel, SDPA backends forced or None)
SETTINGS = {"sdpa": ("sdpa", None), "amx": ("amx", None), "avx512": ("avx512", None), "paged": ("paged", None),
            "math": ("sdpa", [SDPBackend.MATH])}
# Inclusive times; the engine's own ops (attention and the CPU linear layers, kernels/attention_op.py and
# kernels/cpu_linear.py) hold the aten calls where they are present.
ATTENTION_OPS = ("tokenmill::gqa_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math")
GEMM_OPS = ("tokenmill::cpu_linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")


def _prefill(llm: LLM, prompts: list[list[int]], setting: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    kernel, backends = SETTINGS[setting]
    set_prefill_kernel(kernel)
    start = time.perf_counter()
    if backends is None:
        llm.generate(prompts, params)
    else:
        with sdpa_kernel(backends):
            llm.generate(prompts, params)
    return time.perf_counter() - start


def _profile(llm: LLM, prompts: list[list[int]], setting: str) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        total = _prefill(llm, prompts, setting)
    own = {name: 0.0 for name in ATTENTION_OPS + GEMM_OPS}
    for event in prof.key_averages():
        if event.key in own:
            own[event.key] = event.cpu_time_total / 1e6  # inclusive: a GEMM inside math attention counts there too
    attention = own[ATTENTION_OPS[0]] or sum(own[n] for n in ATTENTION_OPS[1:])
    gemm = own[GEMM_OPS[0]] or own["aten::linear"] or sum(own[n] for n in ("aten::mm", "aten::addmm"))
    return {"profiled_seconds": total, "attention_seconds": attention, "linear_seconds": gemm, "ops": own}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=1, help="prompts prefilled together")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="the engine's compute dtype (auto: measured at start-up)")
    parser.add_argument("--settings", default="sdpa,amx", help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--cpu-layer-stack", action="store_true", help="the engine's CPU layer stack on (see above)")
    parser.add_argument("--out", default="benchmarks/results/prefill.json")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    if unknown := [name for name in settings if name not in SETTINGS]:
        parser.error(f"unknown settings {unknown}: choose from {list(SETTINGS)}")

    # No prefix caching: each setting prefills the same prompts, which would otherwise hit the cache.
    llm = LLM(max_model_len=max(2048, args.prompt_len + 8), dtype=args.dtype, enable_prefix_caching=False,
              cpu_layer_stack=args.cpu_layer_stack)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, llm.tokenizer.vocab_size, (args.repeats + 2, args.batch, args.prompt_len),
                            generator=gen).tolist()
    for setting in settings:
        _prefill(llm, [p[:64] for p in prompts[-1]], setting)  # warm-up
    times: dict[str, list[float]] = {s: [] for s in settings}
    for i in range(args.repeats):
        for setting in settings if i % 2 == 0 else settings[::-1]:
            times[setting].append(_prefill(llm, prompts[i], setting))
    profiles = {s: _profile(llm, prompts[-2], s) for s in settings}
    result = {
        "command": " ".join(["python benchmarks/prefill.py", *argv]),
        "dtype": str(llm.engine.runner.model.embed_tokens.weight.dtype),
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "batch": args.batch,
        "cpu_layer_stack": args.cpu_layer_stack,
        "seconds": times, "median_seconds": {s: statistics.median(t) for s, t in times.items()},
        "profiles": profiles,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for setting in settings:
        p = profiles[setting]
        print(f"{setting:>6}: prefill {result['median_seconds'][setting]:.2f} s (median of {args.repeats}); profile: "
              f"attention {p['attention_seconds']:.2f} s, linear layers {p['linear_seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
