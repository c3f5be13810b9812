"""The tool-call formats tokenmill reads and writes. Each names the xgrammar structural-tag family that constrains it
(tool_choice required / named, and the calls of auto), a trigger that starts a call, a header pattern that ends just
before the call's JSON arguments, and how one call is written (for templates that cannot render past calls).

- hermes (Qwen2.5, Hermes, SmolLM-style ChatML templates):
  ``<tool_call>\\n{"name": N, "arguments": {..}}\\n</tool_call>``
- llama3_json (Llama 3.1/3.2): ``{"name": N, "parameters": {..}}``, optionally after ``<|python_tag|>``, calls
  separated by ``;``
- deepseek_v3 (DeepSeek-V3/R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{..}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    structural_tag_model: str  # xgrammar's key for get_model_structural_tag
    triggers: tuple[str, ...]  # text that starts a call; what precedes the first is the message content
    header: re.Pattern  # from a trigger to the first character of the arguments; group "name"
    call_template: str  # one call, written: {name} and {arguments}

    def render_call(self, name: str, arguments: str) -> str:
        return self.call_template.format(name=name, arguments=arguments)


_NAME = r'"name"\s*:\s*"(?P<name>[^"]+)"'
HERMES = ToolFormat(
    "hermes", "qwen_3", ("<tool_call>",),
    re.compile(r'\s*<tool_call>\s*\{\s*' + _NAME + r'\s*,\s*"arguments"\s*:\s*'),
    '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>')
LLAMA3_JSON = ToolFormat(
    "llama3_json", "llama", ('{"name"', "<|python_tag|>"),
    re.compile(r'\s*(?:<\|python_tag\|>)?\s*;?\s*\{\s*' + _NAME + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*'),
    '{{"name": "{name}", "parameters": {arguments}}}')
DEEPSEEK_V3 = ToolFormat(
    "deepseek_v3", "deepseek_r1", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"),
    re.compile(r"\s*(?:<｜tool▁calls▁begin｜>)?\s*<｜tool▁call▁begin｜>\s*(?:function)?\s*<｜tool▁sep｜>\s*"
               r"(?P<name>[^\n<]+?)\s*\n```(?:json)?\s*\n"),
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, DEEPSEEK_V3)}


def detect_format(chat_template: str | None, configured: str = "auto") -> ToolFormat:
    """The configured format, or the one the chat template writes; hermes for templates that write none."""
    if configured != "auto":
        return FORMATS[configured]
    template = chat_template or ""
    if "tool▁calls▁begin" in template or "tool▁call▁begin" in template:
        return DEEPSEEK_V3
    if "<|python_tag|>" in template or '"parameters": ' in template and "ipython" in template:
        return LLAMA3_JSON
    return HERMES


def structural_tag(fmt: ToolFormat, tools: list[dict], tool_choice: str | dict, parallel: bool) -> str:
    """xgrammar's structural tag (JSON) constraining the output to ``fmt``'s calls of ``tools``: for auto, free
    text in which any started call is well formed; for required, calls only (at least one; one with ``parallel``
    false); for a named tool, that call only."""
    import xgrammar as xgr

    tag = json.loads(xgr.get_model_structural_tag(fmt.structural_tag_model, tools=tools, tool_choice=tool_choice,
                                                  reasoning="disabled", parallel_tool_calls=parallel)
                     .model_dump_json())
    body = tag["format"]
    if tool_choice == "required" and body["type"] == "triggered_tags":
        # xgrammar lets text run before, between and after the calls of ``required``; OpenAI's required answers
        # with calls alone, so the calls follow one another, separated by a newline.
        tag["format"] = {"type": "tags_with_separator", "tags": body["tags"], "separator": "\n",
                         "at_least_one": True, "stop_after_first": not parallel}
    return json.dumps(tag)


def arguments_json(arguments: str) -> dict:
    """OpenAI sends past calls' arguments as a JSON string; templates want the object. ValueError if not JSON."""
    value = json.loads(arguments)
    if not isinstance(value, dict):
        raise ValueError("arguments must be a JSON object")
    return value
