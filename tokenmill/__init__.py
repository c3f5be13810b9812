"""tokenmill: a self-hosted, OpenAI-compatible LLM inference server.

``LLM`` and ``SamplingParams`` are imported on first use, so that importing a pure-Python part of the package (the
scheduler, the KV block pool) does not pull in torch.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "GenerationResult", "Completion"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "GenerationResult", "Completion"):
        from tokenmill import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from tokenmill.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
