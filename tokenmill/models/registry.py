"""HF ``architectures`` name -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.models.deepseek import DeepseekForCausalLM
from tokenmill.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
}


def model_class_for(hf_config: dict[str, Any]) -> type[nn.Module]:
    for arch in hf_config.get("architectures") or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"unsupported architecture {hf_config.get('architectures')!r} "
                     f"(supported: {', '.join(sorted(_MODELS))})")
