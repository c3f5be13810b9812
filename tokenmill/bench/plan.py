"""``tokenmill plan``: how much memory a model needs before you buy the GPU.

From an HF config.json (or a preset): weight bytes per weight dtype, KV bytes per token for the model's
attention kind (MHA / GQA: K and V per KV head; MLA: only the latent plus the roped key) in each KV dtype,
the KV cache of one sequence at ``--context``, and how many such sequences fit in ``--memory`` after the
weights at ``--gpu-memory-utilization``. KV sizes come from the engine's own ``KVCacheSpec``.

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
from tokenmill.models.config import ModelConfig, tp_split
from tokenmill.models.quantization import dense_quantized_bytes

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# Weight dtypes that are the engine's --quantization layouts (dense models: linear layers in the format, the rest
# bf16); for MLA / MoE models fp8 keeps its meaning of every weight at one byte (DeepSeek's fp8 checkpoints).
QUANTIZED_WEIGHTS = ("int8", "int4", "fp8")
GiB = 2**30

PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                   "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "tie_word_embeddings": False},
    "llama-3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "tie_word_embeddings": False},
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "tie_word_embeddings": True},
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
                         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                         "first_k_dense_replace": 1, "moe_layer_freq": 1, "tie_word_embeddings": False},
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                    "tie_word_embeddings": False},
}


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


def _attention_parameters(m: ModelConfig) -> int:
    h, heads = m.hidden_size, m.num_heads
    if not m.mla:
        return h * m.head_dim * (2 * heads + 2 * m.num_kv_heads)
    a = m.mla
    q_lora = a.q_lora_rank
    attn = (h * q_lora + q_lora + q_lora * heads * m.head_dim) if q_lora else h * heads * m.head_dim
    attn += h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    attn += a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
    return attn + heads * a.v_head_dim * h


def num_parameters(c: dict[str, Any] | ModelConfig) -> int:
    m = model_config(c)
    h = m.hidden_size
    total = m.vocab_size * h * (1 if m.tie_word_embeddings else 2) + h  # embeddings, head, final norm
    for layer in range(m.num_layers):
        if m.moe and m.moe.is_moe_layer(layer):
            experts = m.moe.num_experts + m.moe.num_shared_experts
            mlp = experts * 3 * h * m.moe.intermediate_size + m.moe.num_experts * h
        else:
            mlp = 3 * h * m.intermediate_size
        total += _attention_parameters(m) + mlp + 2 * h
    return total


def _rank_attention_parameters(m: ModelConfig, tp: int) -> int:
    h, local_heads = m.hidden_size, tp_split(m.num_heads, tp, "attention heads")
    if not m.mla:
        return h * m.head_dim * (2 * local_heads + 2 * m.local_kv_heads(tp))
    a, q_lora = m.mla, m.mla.q_lora_rank
    replicated = (h * q_lora + q_lora if q_lora else 0) + h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    split = (q_lora or h) * local_heads * m.head_dim  # q_b (or q_proj)
    split += a.kv_lora_rank * local_heads * (a.qk_nope_head_dim + a.v_head_dim)  # kv_b
    return replicated + split + local_heads * a.v_head_dim * h  # o_proj


def rank_parameters(c: dict[str, Any] | ModelConfig, tp: int) -> int:
    """Parameters one of ``tp`` tensor-parallel ranks holds (the split of the module docstring; tp=1: all)."""
    m = model_config(c)
    h = m.hidden_size
    vocab = -(-m.vocab_size // tp)  # vocab-parallel shards, the last one padded
    total = vocab * h * (1 if m.tie_word_embeddings else 2) + h
    for layer in range(m.num_layers):
        if m.moe and m.moe.is_moe_layer(layer):
            experts = tp_split(m.moe.num_experts, tp, "routed experts") + m.moe.num_shared_experts / tp
            mlp = int(experts * 3 * h * m.moe.intermediate_size) + m.moe.num_experts * h
        else:
            mlp = 3 * h * tp_split(m.intermediate_size, tp, "the MLP width")
        total += _rank_attention_parameters(m, tp) + mlp + 2 * h
    return total


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
        """Of one GPU."""
        return rank_kv_spec(self.config, dtype, self.tensor_parallel_size).bytes_per_token

    def sequences_that_fit(self, weight_dtype: str, kv_dtype: str) -> int:
        free = int(self.memory * self.utilization) - self.weight_bytes(weight_dtype)
        per_sequence = self.kv_bytes_per_token(kv_dtype) * self.context
        return max(0, free // per_sequence)

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
            per_token = self.kv_bytes_per_token(kv)
            lines.append(f"| {kv} | {per_token:,} | {per_token * self.context / GiB:.3f} GiB | "
                         f"{self.sequences_that_fit(weight_dtype, kv):,} |")
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
            "mha_equivalent_bytes_per_token": {d: mha_equivalent_bytes_per_token(config, d) for d in ELEMENT_BYTES},
            "sequences_that_fit": {d: plan.sequences_that_fit(args.weight_dtype, d) for d in ELEMENT_BYTES}}))
    else:
        print(plan.report(args.weight_dtype))
    return 0
