"""``tokenmill plan``: how much memory a model needs before you buy the GPU.

From an HF config.json (or a preset): weight bytes per weight dtype, KV bytes per token for the model's
attention kind (MHA / GQA: K and V per KV head; MLA: only the latent plus the roped key) in each KV dtype,
the KV cache of one sequence at ``--context``, and how many such sequences fit in ``--memory`` after the
weights at ``--gpu-memory-utilization``. KV sizes come from the engine's own ``KVCacheSpec``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.config import parse_byte_size
from tokenmill.kvcache.spec import ELEMENT_BYTES, KVCacheSpec

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
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
                         "n_routed_experts": 64, "n_shared_experts": 2, "first_k_dense_replace": 1,
                         "moe_layer_freq": 1, "tie_word_embeddings": False},
    "deepseek-v3": {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
                    "first_k_dense_replace": 3, "moe_layer_freq": 1, "tie_word_embeddings": False},
}


def is_mla(c: dict[str, Any]) -> bool:
    return c.get("kv_lora_rank") is not None


def kv_spec(c: dict[str, Any], dtype: str, block_size: int = 16) -> KVCacheSpec:
    """The engine's cache layout for this config: MLA keeps one latent slot, GQA/MHA 2 x KV heads."""
    layers = c["num_hidden_layers"]
    if is_mla(c):
        return KVCacheSpec(layers, 1, c["kv_lora_rank"] + c["qk_rope_head_dim"], dtype, block_size)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return KVCacheSpec.for_gqa(layers, c.get("num_key_value_heads") or heads, head_dim, dtype, block_size)


def mha_equivalent_bytes_per_token(c: dict[str, Any], dtype: str) -> int:
    """K and V for every query head, as an engine that expands MLA's latent would store them."""
    heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
    if is_mla(c):
        k_dim, v_dim = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    else:
        k_dim = v_dim = c.get("head_dim") or c["hidden_size"] // heads
    return layers * heads * (k_dim + v_dim) * ELEMENT_BYTES[dtype]


def attention_kind(c: dict[str, Any]) -> str:
    if is_mla(c):
        return "MLA"
    heads = c["num_attention_heads"]
    return "MHA" if (c.get("num_key_value_heads") or heads) == heads else "GQA"


def num_parameters(c: dict[str, Any]) -> int:
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    total = vocab * h * (1 if c.get("tie_word_embeddings") else 2) + h  # embeddings, head, final norm
    for layer in range(layers):
        if is_mla(c):
            qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            q_lora = c.get("q_lora_rank")
            attn = (h * q_lora + q_lora + q_lora * heads * qk) if q_lora else h * heads * qk
            attn += h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
            attn += c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
            attn += heads * c["v_head_dim"] * h
        else:
            head_dim = c.get("head_dim") or h // heads
            kv_heads = c.get("num_key_value_heads") or heads
            attn = h * head_dim * (2 * heads + 2 * kv_heads)
        moe = c.get("n_routed_experts") and layer >= c.get("first_k_dense_replace", 0) \
            and layer % c.get("moe_layer_freq", 1) == 0
        if moe:
            experts = c["n_routed_experts"] + c.get("n_shared_experts", 0)
            mlp = experts * 3 * h * c["moe_intermediate_size"] + c["n_routed_experts"] * h
        else:
            mlp = 3 * h * c["intermediate_size"]
        total += attn + mlp + 2 * h
    return total


@dataclass
class Plan:
    name: str
    config: dict[str, Any]
    context: int
    memory: int
    utilization: float

    def weight_bytes(self, dtype: str) -> int:
        return num_parameters(self.config) * WEIGHT_BYTES[dtype]

    def sequences_that_fit(self, weight_dtype: str, kv_dtype: str) -> int:
        free = int(self.memory * self.utilization) - self.weight_bytes(weight_dtype)
        per_sequence = kv_spec(self.config, kv_dtype).bytes_per_token * self.context
        return max(0, free // per_sequence)

    def report(self, weight_dtype: str) -> str:
        c = self.config
        lines = [f"# {self.name}: {attention_kind(c)} attention, {c['num_hidden_layers']} layers, "
                 f"{num_parameters(c) / 1e9:.2f} B parameters", "",
                 "| weights | bytes |", "|---|---|"]
        lines += [f"| {d} | {self.weight_bytes(d) / GiB:.2f} GiB |" for d in ("bf16", "fp8")]
        lines += ["", f"KV cache at {self.context} tokens per sequence; {self.memory / GiB:.0f} GiB x "
                      f"{self.utilization} minus {weight_dtype} weights:", "",
                  "| KV dtype | bytes/token | per sequence | sequences that fit |", "|---|---|---|---|"]
        for kv in ("bf16", "fp8"):
            per_token = kv_spec(c, kv).bytes_per_token
            lines.append(f"| {kv} | {per_token:,} | {per_token * self.context / GiB:.3f} GiB | "
                         f"{self.sequences_that_fit(weight_dtype, kv):,} |")
        ratio = mha_equivalent_bytes_per_token(c, "bf16") / kv_spec(c, "bf16").bytes_per_token
        lines += ["", f"K/V for every query head would take {ratio:.1f}x the bf16 bytes per token."]
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help=f"a config.json path or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--memory", default="80GiB", help="accelerator memory")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--weight-dtype", choices=sorted(WEIGHT_BYTES), default="bf16")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.model in PRESETS:
        config = PRESETS[args.model]
    else:
        with open(args.model) as fh:
            config = json.load(fh)
    plan = Plan(args.model, config, args.context, parse_byte_size(args.memory), args.gpu_memory_utilization)
    if args.json:
        print(json.dumps({
            "attention": attention_kind(config), "parameters": num_parameters(config),
            "weight_bytes": {d: plan.weight_bytes(d) for d in WEIGHT_BYTES},
            "kv_bytes_per_token": {d: kv_spec(config, d).bytes_per_token for d in ELEMENT_BYTES},
            "mha_equivalent_bytes_per_token": {d: mha_equivalent_bytes_per_token(config, d) for d in ELEMENT_BYTES},
            "sequences_that_fit": {d: plan.sequences_that_fit(args.weight_dtype, d) for d in ELEMENT_BYTES}}))
    else:
        print(plan.report(args.weight_dtype))
    return 0
