"""The reasoning split, fed whole and fed one character at a time (every tag cut at every position): the same
reasoning and answer, equal to a plain split of the text at its tags."""

import json

import pytest

from tokenmill.tools.formats import GPT_OSS as GPT_OSS_TOOLS
from tokenmill.tools.formats import HERMES
from tokenmill.tools.parser import ToolCallParser
from tokenmill.tools.reasoning import DEEPSEEK_R1, GPT_OSS, QWEN3, ReasoningParser, detect_reasoning
from tokenmill.tools.split import reasoning_parser


def split(fmt, text: str, step: int) -> tuple[str, str]:
    parser, reasoning, content = ReasoningParser(fmt), "", ""
    for i in range(0, len(text), step):
        r, c = parser.feed(text[i:i + step])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    assert (parser.reasoning, parser.content) == (reasoning + r, content + c)
    return reasoning + r, content + c


@pytest.mark.parametrize("step", [1, 2, 3, 1000])
@pytest.mark.parametrize("fmt, text, want", [
    (QWEN3, "<think>\nLet me see. 2 < 3.\n</think>\n\nParis.", ("\nLet me see. 2 < 3.\n", "Paris.")),
    (QWEN3, "Paris, no thinking.", ("", "Paris, no thinking.")),
    (QWEN3, "<think></think>Paris", ("", "Paris")),
    (QWEN3, "<thin", ("", "<thin")),  # an opening that never completes is answer
    (QWEN3, "<think>unfinished </thi", ("unfinished </thi", "")),  # so is thinking that never closes: reasoning
    (DEEPSEEK_R1, "The user asks.</think>\n\nParis <think> stays", ("The user asks.", "Paris <think> stays")),
    (DEEPSEEK_R1, "all thinking, cut off", ("all thinking, cut off", "")),
])
def test_split_is_the_same_however_the_text_arrives(fmt, text, want, step):
    assert split(fmt, text, step) == want


def test_detect_from_the_template():
    qwen3 = "{% if message.role == 'assistant' %}<think>{{ reasoning }}</think>{% endif %}" \
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    r1 = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
    assert detect_reasoning(qwen3, "auto") is QWEN3 and detect_reasoning(r1, "auto") is DEEPSEEK_R1
    # Qwen3's and GLM-4.5's switch closes an empty thinking in the generation prompt: that is not R1's opening.
    switch = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and " \
             "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
    glm = "{%- if add_generation_prompt -%}<|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined " \
          "and not enable_thinking) else '' -}}{%- endif -%}"
    assert detect_reasoning(qwen3 + switch, "auto") is QWEN3 and detect_reasoning(glm, "auto") is QWEN3
    assert detect_reasoning("{{ messages }}", "auto") is None and detect_reasoning(qwen3, "none") is None
    assert detect_reasoning(None, "deepseek_r1") is DEEPSEEK_R1


@pytest.mark.parametrize("fmt, text", [
    (QWEN3, '<think>I could write <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> here.</think>\n\n'
            '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'),
    (GPT_OSS, '<|channel|>analysis<|message|>Maybe <|channel|>commentary to=functions.f <|constrain|>json<|message|>'
              '{"a": 1} no.<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>'
              '{"a": 2}<|call|>')])
def test_a_tool_call_inside_the_thinking_is_not_a_call(fmt, text):
    """What every API does with an output (server/chat.py, anthropic.py, responses.py): the reasoning reader first,
    then the tool-call parser over the answer only; streamed the same."""
    tool_format = {"qwen3": HERMES, "gpt_oss": GPT_OSS_TOOLS}[fmt.name]
    for cuts in ([], list(range(1, len(text)))):
        reasoner, parser, thinking = reasoning_parser(fmt), ToolCallParser(tool_format), ""
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            more, answer = reasoner.step(text[a:b], b == len(text))
            thinking += more
            parser.step(answer, b == len(text))
        assert [json.loads(c.arguments) for c in parser.calls] == [{"a": 2}]
        assert '{"a": 1}' in thinking
