"""tokenmill: a self-hosted, OpenAI-compatible LLM inference server."""

from tokenmill.llm import LLM, Completion, GenerationResult
from tokenmill.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationResult", "Completion"]
__version__ = "0.1.0"
