"""The reader that splits a model's thinking from its answer, by reasoning format: harmony's channels for gpt_oss
(tools/harmony.py), think tags for the others (tools/reasoning.py)."""

from __future__ import annotations

from tokenmill.tools.harmony import HarmonyParser
from tokenmill.tools.reasoning import GPT_OSS, ReasoningFormat, ReasoningParser


def reasoning_parser(fmt: ReasoningFormat) -> ReasoningParser | HarmonyParser:
    return HarmonyParser(fmt) if fmt is GPT_OSS else ReasoningParser(fmt)
