"""Loading the Llama-style families (models/llama.py): HF names -> parameters, fusing q/k/v and gate/up (the dense
MLPs' and the shared experts'), routed experts per expert or fused (models/expert_weights.py), and each
tensor-parallel rank's slice of every tensor (``weight_shard``)."""

from __future__ import annotations

import re
from typing import Iterable

import torch

from tokenmill.models.expert_weights import PER_EXPERT, fused_experts
from tokenmill.models.base import mlp_sources
from tokenmill.models.loader import SKIP

# A multimodal wrapper's text model (Gemma3ForConditionalGeneration): its prefixes as released and as
# transformers 5 names them; the vision tower and projector are not served.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_NOT_TEXT = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.")


def text_name(name: str) -> str | None:
    """A checkpoint name as the text model's (None: a tensor of the vision side)."""
    if name.startswith(_NOT_TEXT):
        return None
    for wrapped, plain in _TEXT_PREFIXES:
        if name.startswith(wrapped):
            return plain + name.removeprefix(wrapped)
    return name


# Router tensors as the families name them -> MoE's parameters.
_ROUTER = {"gate.weight": "gate_weight", "gate.e_score_correction_bias": "e_score_correction_bias",
           "router.weight": "gate_weight", "router.bias": "gate_bias"}


class LlamaWeights:
    """Mixed into LlamaForCausalLM: reads its ``config``, ``tp``, ``layers``."""

    def _local_experts(self) -> int:
        return self.config.moe.num_experts // self.tp.size

    def _beyond_decoder(self, name: str) -> bool:
        """A layer past the decoder's: GLM-4.5's multi-token-prediction layer (num_nextn_predict_layers), not run."""
        m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= self.config.num_layers

    def weight_shard(self, name: str):
        """The (dimension, slice) of checkpoint tensor ``name`` this rank loads; None: all of it; SKIP: none of it
        (another rank's experts)."""
        a, tp = self.config, self.tp
        name = text_name(name)
        if name is None or self._beyond_decoder(name):
            return SKIP
        if tp.size == 1:
            return None
        if m := PER_EXPERT.fullmatch(name.removeprefix("model.")):
            local = self._local_experts()
            return None if int(m.group(2)) // local == tp.rank else SKIP
        if ".mlp.experts." in name:  # fused experts (and their MXFP4 blocks, scales, biases): [E, ...]
            return 0, slice(*tp.span(a.moe.num_experts))
        if name.endswith("self_attn.sinks"):
            return 0, slice(*tp.span(a.num_heads))
        part = name.split(".")[-2]
        q_size, d = a.num_heads * a.head_dim, a.head_dim
        if part == "q_proj":
            return 0, slice(*tp.span(q_size))
        if part in ("k_proj", "v_proj"):
            first = tp.rank * a.num_kv_heads // tp.size  # this rank's first KV head (or its replicated one)
            return 0, slice(first * d, (first + a.local_kv_heads(tp.size)) * d)
        if part == "o_proj":
            return (1, slice(*tp.span(q_size))) if name.endswith(".weight") else None
        if part in ("gate_proj", "up_proj", "down_proj"):
            width = a.moe.intermediate_size * a.moe.num_shared_experts if "shared_experts" in name \
                else a.intermediate_size
            return int(part == "down_proj"), slice(*tp.span(width))
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.embed_tokens.shard(a.vocab_size)
        return None

    def linear_sources(self) -> dict[str, tuple[str, ...]]:
        """Each linear layer (module path) -> the checkpoint modules its weight is made of, in row order."""
        sources = {}
        for i, layer in enumerate(self.layers):
            ckpt = f"model.layers.{i}"
            sources[f"layers.{i}.self_attn.qkv_proj"] = tuple(f"{ckpt}.self_attn.{p}_proj" for p in "qkv")
            sources[f"layers.{i}.self_attn.o_proj"] = (f"{ckpt}.self_attn.o_proj",)
            sources.update(mlp_sources(i, layer.mlp))
        sources["lm_head"] = ("model.embed_tokens",) if self.config.tie_word_embeddings else ("lm_head",)
        return sources

    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint tensor ``name`` -> (this model's parameter or buffer name, the first row it fills in a fused
        q/k/v or gate/up tensor, else None); None for tensors the model does not keep (rotary tables)."""
        name = text_name(name)
        if name is None or "rotary_emb" in name or self._beyond_decoder(name):
            return None
        if m := PER_EXPERT.fullmatch(name.removeprefix("model.")):  # copied by _copy_expert
            return f"{m.group(1)}.{'w_down' if m.group(3) == 'down' else 'w_gate_up'}", None
        parts = name.removeprefix("model.").split(".")
        if len(parts) >= 3 and parts[-3] == "mlp" and ".".join(parts[-2:]) in _ROUTER:
            return ".".join(parts[:-2] + [_ROUTER[".".join(parts[-2:])]]), None
        if len(parts) >= 2 and parts[-2] in ("q_proj", "k_proj", "v_proj"):
            attn = self.layers[0].self_attn
            offset = {"q_proj": 0, "k_proj": attn.q_size, "v_proj": attn.q_size + attn.kv_size}[parts[-2]]
            return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), offset
        if len(parts) >= 2 and parts[-2] in ("gate_proj", "up_proj"):
            owner = ".".join(parts[:-2])
            offset = self.get_submodule(owner).intermediate if parts[-2] == "up_proj" else 0
            return f"{owner}.gate_up_proj.{parts[-1]}", offset
        return self.tied_head_target(".".join(parts)), None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (this rank's slices, ``weight_shard``) in; every parameter and quantized buffer
        must be filled exactly once."""
        params = self.loadable_tensors()
        filled: dict[str, int] = {}
        text = ((text_name(name), tensor) for name, tensor in weights)
        for name, tensor in fused_experts((name, tensor) for name, tensor in text if name is not None):
            if self._beyond_decoder(name):  # weight_shard skips these unread; a loader that does not ask skips here
                continue
            if m := PER_EXPERT.fullmatch(name.removeprefix("model.")):
                self._copy_expert(m, tensor, params, filled)
                continue
            target = self.weight_target(name)
            if target is None:
                continue
            name, offset = target
            if self.copy_quantized(name, offset, tensor, filled):
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            if self.tp.rank > 0 and re.search(r"o_proj\.bias$", name):
                tensor = torch.zeros_like(tensor)  # a partial sum's bias: added once, by rank 0
            dst = params[name] if offset is None else params[name][offset:offset + tensor.shape[0]]
            self.copy_weight(name, dst, tensor, filled)
        self.finish_loading(filled, self.config.tie_word_embeddings)

    def _copy_expert(self, m: re.Match, tensor: torch.Tensor, params: dict[str, torch.Tensor],
                     filled: dict[str, int]) -> None:
        prefix, kind = m.group(1), m.group(3)
        expert = int(m.group(2)) - self.tp.rank * (self._local_experts() if self.tp.size > 1 else 0)
        if kind == "down":
            name = f"{prefix}.w_down"
            self.copy_weight(name, params[name][expert], tensor, filled)
            return
        name, inter = f"{prefix}.w_gate_up", self.config.moe.intermediate_size
        rows = slice(0, inter) if kind == "gate" else slice(inter, 2 * inter)
        self.copy_weight(name, params[name][expert, rows], tensor, filled)
