"""HF ``architectures`` name -> model class."""

from __future__ import annotations

from torch import nn

from tokenmill.models.config import KNOWN_ARCHITECTURES, ModelConfig
from tokenmill.models.deepseek import DeepseekForCausalLM
from tokenmill.models.families import GQA_FAMILIES
from tokenmill.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    **{architecture: LlamaForCausalLM for architecture in GQA_FAMILIES},
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekForCausalLM,  # + DeepSeek Sparse Attention (models/layers/dsa.py)
    "GlmMoeDsaForCausalLM": DeepseekForCausalLM,
}


assert set(_MODELS) == set(KNOWN_ARCHITECTURES), "models/config.py must know every architecture served here"


def model_class_for(config: ModelConfig) -> type[nn.Module]:
    if config.architecture in _MODELS:
        return _MODELS[config.architecture]
    raise ValueError(f"unsupported architecture {config.architecture!r} (supported: {', '.join(sorted(_MODELS))})")
