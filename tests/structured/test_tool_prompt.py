"""Tools and past calls reach the chat template: natively when it reads them, as text in the model's format when
it does not (SmolLM2's template)."""

import json

import jinja2
import pytest

from tokenmill.tools.formats import HERMES
from tokenmill.tools.parser import parse_tool_calls
from tokenmill.tools.prompt import render_messages, template_knows_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]
# A template in transformers' convention (as Qwen2.5's): tools as objects, calls' arguments as objects.
NATIVE = ("{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }}"
          "{% for c in m.tool_calls or [] %}[{{ c.function.name }}({{ c.function.arguments.city }})]{% endfor %}|"
          "{% endfor %}")


def test_native_templates_get_objects():
    assert template_knows_tools(NATIVE)
    rendered = jinja2.Template(NATIVE).render(messages=render_messages(MESSAGES, TOOLS, HERMES, native=True),
                                              tools=TOOLS)
    assert rendered == 'T:get_weather;user:Weather in Paris?|assistant:[get_weather(Paris)]|tool:{"temp": 21}|'


def test_other_templates_get_the_format_as_text(smollm_llm):
    template = smollm_llm.tokenizer.hf.chat_template
    assert not template_knows_tools(template)
    messages = render_messages(MESSAGES, TOOLS, HERMES, native=False)
    assert messages[0]["role"] == "system" and json.dumps(TOOLS[0]) in messages[0]["content"]
    assert parse_tool_calls(HERMES, messages[2]["content"])[1][0].arguments == '{"city": "Paris"}'
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    text = smollm_llm.tokenizer.hf.apply_chat_template(messages, tokenize=False)
    assert "<tool_response>" in text and "get_weather" in text


def test_arguments_that_are_not_json_are_refused():
    bad = [{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f",
                                                                                       "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match="messages.0.tool_calls"):
        render_messages(bad, TOOLS, HERMES, native=False)
