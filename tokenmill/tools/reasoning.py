"""Reasoning read out of generated text, incrementally: the thinking between a model's think tags apart from the
answer after them (``reasoning_content`` and ``content``), as vLLM's reasoning parsers split them.

Formats:
- deepseek_r1 (DeepSeek-R1 and the templates that open ``<think>`` in the generation prompt): the output starts
  inside the thinking; everything up to ``</think>`` is reasoning (all of it, if the tag never comes);
- qwen3 / glm45 (Qwen3, GLM-4.5: the model writes ``<think>...</think>`` itself, or the template closes an empty one
  when thinking is off): reasoning only between the tags; an output that does not open with ``<think>`` is all answer.
A tail that may be the start of a tag is held back until the next delta decides it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    starts_inside: bool  # the generation prompt already opened the thinking
    separator: str = r"\s*"  # what may come between the thinking's end and the answer (a regex)


DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", "<think>", "</think>", True)
QWEN3 = ReasoningFormat("qwen3", "<think>", "</think>", False)
GLM45 = ReasoningFormat("glm45", "<think>", "</think>", False)
# gpt-oss's harmony channels (tools/harmony.py reads them): the analysis message is the thinking.
GPT_OSS = ReasoningFormat("gpt_oss", "<|channel|>analysis<|message|>", "<|end|>", False, r"(?:<\|start\|>assistant)?")
REASONING_FORMATS = {f.name: f for f in (DEEPSEEK_R1, QWEN3, GLM45, GPT_OSS)}


_EMPTY_THINKING = re.compile(r"<think>(?:\\n|\s)*</think>")


def detect_reasoning(chat_template: str | None, requested: str) -> ReasoningFormat | None:
    """``requested`` by name, none, or (auto) from the chat template: one that writes ``<think>`` thinks; one whose
    generation prompt ends by opening it (``<think>\\n`` right after the assistant's turn starts) is deepseek_r1."""
    if requested == "none":
        return None
    if requested != "auto":
        return REASONING_FORMATS[requested]
    template = chat_template or ""
    if "<|channel|>" in template:
        return GPT_OSS
    if "<think>" not in template:
        return None
    generation = template[template.rfind("add_generation_prompt"):]
    # An empty thinking closed at once is thinking switched off (Qwen3's and GLM-4.5's enable_thinking=false), not
    # thinking opened for the model.
    generation = _EMPTY_THINKING.sub("", generation)
    return DEEPSEEK_R1 if "<think>\\n" in generation or "<think>\n" in generation else QWEN3


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningParser:
    fmt: ReasoningFormat
    state: str = ""  # "START" (may still open), "THINKING", "CLOSED" (newlines after the end tag), "ANSWER"
    pending: str = ""  # text not yet decided
    reasoning: str = ""
    content: str = ""

    def __post_init__(self) -> None:
        self.state = self.state or ("THINKING" if self.fmt.starts_inside else "START")

    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and the answer text that ``delta`` completes."""
        text, reasoning, content = self.pending + delta, "", ""
        self.pending = ""
        while text:
            if self.state == "START":
                stripped = text.lstrip()
                if stripped.startswith(self.fmt.start):
                    text, self.state = stripped[len(self.fmt.start):], "THINKING"
                elif self.fmt.start.startswith(stripped):
                    self.pending, text = text, ""  # may still become the opening tag
                else:
                    self.state = "ANSWER"
            elif self.state == "THINKING":
                end = text.find(self.fmt.end)
                if end >= 0:
                    reasoning += text[:end]
                    text, self.state = text[end + len(self.fmt.end):], "CLOSED"
                else:
                    keep = held_back(text, self.fmt.end)
                    reasoning += text[:len(text) - keep]
                    self.pending, text = text[len(text) - keep:], ""
            elif self.state == "CLOSED":  # the newlines that separate the answer from the thinking are dropped
                text = text.lstrip("\n")
                if text:
                    self.state = "ANSWER"
            else:
                content, text = content + text, ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def step(self, delta: str, finished: bool) -> tuple[str, str]:
        """``feed``, and on the output's last delta ``finish`` too: the reasoning and answer text to send now."""
        thinking, answer = self.feed(delta)
        if finished:
            more, rest = self.finish()
            thinking, answer = thinking + more, answer + rest
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning inside an unclosed thinking, else answer."""
        rest, self.pending = self.pending, ""
        if self.state == "THINKING":
            self.reasoning += rest
            return rest, ""
        self.content += rest
        return "", rest

