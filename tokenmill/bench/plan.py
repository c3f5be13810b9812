"""``tokenmill plan``: how much memory a model needs before you buy the GPU.

From an HF config.json (or a preset: bench/presets.py): weight bytes per weight dtype (the engine's own modules,
counted on the meta device), KV bytes per token for the model's attention kind (MHA / GQA: K and V per KV head; MLA:
only the latent plus the roped key) in each KV dtype, the KV cache of one sequence at ``--context`` (sliding-window
layers hold only their window), and how many such sequences fit in ``--memory`` after the weights at
``--gpu-memory-utilization``. KV sizes come from the engine's own ``KVCacheSpec``.

With ``--tensor-parallel-size N`` every figure is per GPU, for the usual split (Megatron / vLLM): attention heads,
MLP and the shared experts' columns and rows, and the vocabulary of the embedding and LM head divided by N; routed
experts divided by N (expert parallel); norms, the router and MLA's down-projections (q_a, kv_a) replicated. KV heads
are split too, and replicated when fewer than N (each rank keeps one). MLA's latent cache is replicated: every head
reads the whole latent, so each rank stores all of it for its heads. A sequence occupies every rank, so "sequences
that fit" on one GPU is what the group fits.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.config import parse_byte_size
from tokenmill.kvcache.spec import ELEMENT_BYTES, KVCacheSpec
from tokenmill.bench.presets import PRESETS
from tokenmill.models.config import ModelConfig
from tokenmill.models.quantization import dense_quantized_bytes

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# Weight dtypes that are the engine's --quantization layouts (dense models: linear layers in the format, the rest
# bf16); for MLA / MoE models fp8 keeps its meaning of every weight at one byte (DeepSeek's fp8 checkpoints).
QUANTIZED_WEIGHTS = ("int8", "int4", "fp8")
GiB = 2**30

def model_config(c: dict[str, Any] | ModelConfig) -> ModelConfig:
    return c if isinstance(c, ModelConfig) else ModelConfig.from_hf(c)


def kv_spec(c: dict[str, Any] | ModelConfig, dtype: str, block_size: int = 16) -> KVCacheSpec:
    """The engine's own cache layout for this config: MLA keeps one latent slot, GQA/MHA 2 x KV heads."""
    return model_config(c).kv_cache_spec(dtype, block_size)


def mha_equivalent_bytes_per_token(c: dict[str, Any] | ModelConfig, dtype: str) -> int:
    """K and V for every query head, as an engine that expands MLA's latent would store them."""
    m = model_config(c)
    v_dim = m.mla.v_head_dim if m.mla else m.head_dim
    return m.num_layers * m.num_heads * (m.head_dim + v_dim) * ELEMENT_BYTES[dtype]


def attention_kind(c: dict[str, Any] | ModelConfig) -> str:
    return model_config(c).attention_kind


def rank_parameters(c: dict[str, Any] | ModelConfig, tp: int = 1) -> int:
    """Parameters one of ``tp`` tensor-parallel ranks holds (tp=1: all): the engine's own modules for the model, built
    on the meta device (no memory), so every family's norms, biases, sinks, routers and experts count as served. A
    tied LM head counts once."""
    import torch

    from tokenmill.distributed.group import TensorParallel
    from tokenmill.models.registry import model_class_for

    m = model_config(c)
    with torch.device("meta"):
        model = model_class_for(m)(m, tp=TensorParallel(0, tp))
    return sum(p.numel() for name, p in model.named_parameters()
               if not (m.tie_word_embeddings and name == "lm_head.weight"))


def num_parameters(c: dict[str, Any] | ModelConfig) -> int:
    return rank_parameters(c, 1)


def rank_kv_spec(c: dict[str, Any] | ModelConfig, dtype: str, tp: int, block_size: int = 16) -> KVCacheSpec:
    """One rank's KV cache layout: its KV heads (GQA/MHA), or the whole latent (MLA, replicated)."""
    return model_config(c).kv_cache_spec(dtype, block_size, tp)


@dataclass
class Plan:
    name: str
    config: dict[str, Any]
    context: int
    memory: int  # of one GPU
    utilization: float
    tensor_parallel_size: int = 1
    group_size: int = 128  # --quantization-group-size, for int4

    def weight_bytes(self, dtype: str) -> int:
        """Of one GPU."""
        m = model_config(self.config)
        if dtype in QUANTIZED_WEIGHTS and not (dtype == "fp8" and (m.mla or m.moe)):
            if m.mla or m.moe:
                raise ValueError(f"--weight-dtype {dtype}: quantized weights are not built for {m.architecture} yet")
            if self.tensor_parallel_size > 1:
                raise ValueError(f"--weight-dtype {dtype}: quantized weights are not built for tensor parallelism yet")
            return dense_quantized_bytes(m, dtype, self.group_size)
        return rank_parameters(self.config, self.tensor_parallel_size) * WEIGHT_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Of one GPU: every layer's K/V of one token (what a request costs per token without sliding windows)."""
        return rank_kv_spec(self.config, dtype, self.tensor_parallel_size).bytes_per_token

    def kv_bytes_per_sequence(self, dtype: str) -> int:
        """Of one GPU: what one sequence of ``context`` tokens holds in the engine's blocks (a sliding-window layer
        only its window: kvcache/groups.py)."""
        return rank_kv_spec(self.config, dtype, self.tensor_parallel_size).bytes_for_tokens(self.context)

    def sequences_that_fit(self, weight_dtype: str, kv_dtype: str) -> int:
        free = int(self.memory * self.utilization) - self.weight_bytes(weight_dtype)
        return max(0, free // self.kv_bytes_per_sequence(kv_dtype))

    def report(self, weight_dtype: str) -> str:
        c, tp = self.config, self.tensor_parallel_size
        per = "" if tp == 1 else " per GPU"
        lines = [f"# {self.name}: {attention_kind(c)} attention, {c['num_hidden_layers']} layers, "
                 f"{num_parameters(c) / 1e9:.2f} B parameters" + (f", tensor parallel on {tp} GPUs" if tp > 1 else ""),
                 "", f"| weights{per} | bytes |", "|---|---|"]
        shown = dict.fromkeys(("bf16", "fp8", weight_dtype))
        lines += [f"| {d} | {self.weight_bytes(d) / GiB:.2f} GiB |" for d in shown]
        lines += ["", f"KV cache at {self.context} tokens per sequence; {self.memory / GiB:.0f} GiB x "
                      f"{self.utilization} minus {weight_dtype} weights{per}:", "",
                  f"| KV dtype | bytes/token{per} | per sequence{per} | sequences that fit |", "|---|---|---|---|"]
        for kv in ("bf16", "fp8"):
            lines.append(f"| {kv} | {self.kv_bytes_per_token(kv):,} | {self.kv_bytes_per_sequence(kv) / GiB:.3f} GiB | "
                         f"{self.sequences_that_fit(weight_dtype, kv):,} |")
        groups = kv_spec(c, "bf16").groups
        if any(groups.windows):
            full = self.kv_bytes_per_token("bf16") * self.context
            windowed = sum(len(layers) for w, layers in zip(groups.windows, groups.layers) if w)
            share = self.kv_bytes_per_sequence("bf16") / full
            lines += ["", f"{windowed} of {groups.num_layers} layers have a sliding window "
                          f"({', '.join(map(str, sorted({w for w in groups.windows if w})))} tokens) and hold only it: "
                          f"a sequence takes {share:.0%} of full-length caching."]
        ratio = mha_equivalent_bytes_per_token(c, "bf16") / kv_spec(c, "bf16").bytes_per_token
        lines += ["", f"K/V for every query head would take {ratio:.1f}x the bf16 bytes per token."]
        return "\n".join(lines)


def _quantized_refused(plan: Plan) -> bool:
    try:
        plan.weight_bytes("int8")
    except ValueError:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help=f"a config.json path or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--memory", default="80GiB", help="memory of one accelerator")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split across")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--weight-dtype", choices=sorted({*WEIGHT_BYTES, *QUANTIZED_WEIGHTS}), default="bf16",
                        help="int8 / int4 / fp8: the layout of `tokenmill serve --quantization` (dense models: linear "
                             "layers quantized, the rest bf16)")
    parser.add_argument("--quantization-group-size", type=int, default=128, help="inputs per scale of int4")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.model in PRESETS:
        config = PRESETS[args.model]
    else:
        with open(args.model) as fh:
            config = json.load(fh)
    plan = Plan(args.model, config, args.context, parse_byte_size(args.memory), args.gpu_memory_utilization,
                args.tensor_parallel_size, args.quantization_group_size)
    try:
        plan.weight_bytes(args.weight_dtype)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps({
            "attention": attention_kind(config), "parameters": num_parameters(config),
            "tensor_parallel_size": args.tensor_parallel_size,
            "weight_bytes": {d: plan.weight_bytes(d) for d in WEIGHT_BYTES | dict.fromkeys(QUANTIZED_WEIGHTS)
                             if d not in ("int8", "int4") or d == args.weight_dtype or not _quantized_refused(plan)},
            "kv_bytes_per_token": {d: plan.kv_bytes_per_token(d) for d in ELEMENT_BYTES},
            "kv_bytes_per_sequence": {d: plan.kv_bytes_per_sequence(d) for d in ELEMENT_BYTES},
            "mha_equivalent_bytes_per_token": {d: mha_equivalent_bytes_per_token(config, d) for d in ELEMENT_BYTES},
            "sequences_that_fit": {d: plan.sequences_that_fit(args.weight_dtype, d) for d in ELEMENT_BYTES}}))
    else:
        print(plan.report(args.weight_dtype))
    return 0
