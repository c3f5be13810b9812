"""gpt-oss's harmony channels read apart (tools/harmony.py): analysis as reasoning, final as the answer, a message to
a function as one canonical tool call the gpt_oss tool format parses; the same however the text arrives."""

import json
import random

import pytest

from tokenmill.tools.formats import GPT_OSS as GPT_OSS_TOOLS
from tokenmill.tools.formats import detect_format
from tokenmill.tools.harmony import HarmonyParser
from tokenmill.tools.parser import parse_tool_calls
from tokenmill.tools.reasoning import GPT_OSS, detect_reasoning

ARGS = {"city": "Paris", "note": "a <|message|> inside a string? no: {braces} only"}
CALL = f'<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{json.dumps(ARGS)}<|call|>'
CASES = {
    "answer": ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>"
               "Hello there!<|return|>", "The user greets.", "Hello there!"),
    "call": ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + CALL,
             "Need the weather.", CALL),
    # The recipient in the role header, as the model may also write it: passed on in the one spelling.
    "recipient first": ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant to=functions.get_weather"
                        f"<|channel|>commentary json<|message|>{json.dumps(ARGS)}<|call|>", "Hm.", CALL),
    "no harmony": ("Just text, no channels.", "", "Just text, no channels."),
}


def split(text: str, cuts: list[int]) -> tuple[str, str]:
    parser, reasoning, content = HarmonyParser(GPT_OSS), "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        r, c = parser.step(text[a:b], b == len(text))
        reasoning, content = reasoning + r, content + c
    assert (parser.reasoning, parser.content) == (reasoning, content)
    return reasoning, content


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seed", range(4))
def test_channels_split_however_the_text_arrives(name, seed):
    text, reasoning, content = CASES[name]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1))) if seed else list(range(1, len(text)))
    assert split(text, cuts) == (reasoning, content)


def test_the_tool_format_reads_the_canonical_call():
    content, calls = parse_tool_calls(GPT_OSS_TOOLS, split(CASES["recipient first"][0], [])[1])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]


def test_detected_from_the_template():
    template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    assert detect_reasoning(template, "auto") is GPT_OSS and detect_format(template) is GPT_OSS_TOOLS
