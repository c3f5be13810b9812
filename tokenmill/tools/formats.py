"""The tool-call formats tokenmill reads and writes. Each names the xgrammar structural-tag family that constrains it
(tool_choice required / named, and the calls of auto), a trigger that starts a call, a header pattern that ends just
before the call's JSON arguments, and how one call is written (for templates that cannot render past calls).

- hermes (Qwen2.5, Hermes, SmolLM-style ChatML templates):
  ``<tool_call>\\n{"name": N, "arguments": {..}}\\n</tool_call>``
- llama3_json (Llama 3.1/3.2): ``{"name": N, "parameters": {..}}``, optionally after ``<|python_tag|>``, calls
  separated by ``;``
- deepseek_v3 (DeepSeek-V3/R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{..}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
- kimi_k2 (Kimi-K2): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{..}
  <|tool_call_end|>...<|tool_calls_section_end|>``; the call's id is the header's ``functions.N:i`` (the template
  writes ids back as they came)
- qwen3_coder (Qwen3-Coder, Qwen3.5): ``<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>...</function>\\n
  </tool_call>``: XML parameters, read into JSON arguments typed by the tool's schema
- glm45 (GLM-4.5 .. 4.7): ``<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>``, likewise
- gpt_oss (harmony): ``<|channel|>commentary to=functions.N <|constrain|>json<|message|>{..}<|call|>``, as
  tools/harmony.py spells the model's calls
- mistral (tokenizers v11+): ``[TOOL_CALLS]N[ARGS]{..}`` per call (``[TOOL_CALLS]N[CALL_ID]I[ARGS]{..}`` too)
- pythonic (Llama-4, Llama-3.2's pythonic template): ``[N(k=v, ...), M(...)]``, Python keyword arguments read into
  JSON arguments
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    structural_tag_model: str | None  # xgrammar's key for get_model_structural_tag (None: structural_tag builds one)
    triggers: tuple[str, ...]  # text that starts a call; what precedes the first is the message content
    header: re.Pattern  # from a trigger to the first character of the arguments; group "name"
    call_template: str  # one call, written: {name} and {arguments}
    # XML arguments (None: JSON): one parameter's opening (group "key"), what ends its value, what ends the call,
    # and one parameter written ({key}, {value}).
    xml: XmlArguments | None = None
    python: bool = False  # Python keyword arguments (pythonic), read into JSON arguments
    next_calls: tuple[str, ...] = ()  # what starts a call after the first (default: the triggers)

    def render_call(self, name: str, arguments: str) -> str:
        if self.python:
            values = json.loads(arguments) if arguments.strip().startswith("{") else {}
            arguments = ", ".join(f"{k}={python_literal(v)}" for k, v in values.items())
        elif self.xml is not None:
            values = json.loads(arguments) if arguments.strip().startswith("{") else {}
            arguments = "".join(self.xml.param_template.format(key=k, value=v if isinstance(v, str) else json.dumps(v))
                                for k, v in values.items())
        return self.call_template.format(name=name, arguments=arguments)


def python_literal(value) -> str:
    """A JSON value written as the Python literal a pythonic call holds."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class XmlArguments:
    key: re.Pattern
    value_end: str
    call_end: str
    param_template: str


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

KIMI_K2 = ToolFormat(
    "kimi_k2", "kimi", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
    re.compile(r"\s*(?:<\|tool_calls_section_begin\|>)?\s*<\|tool_call_begin\|>\s*"
               r"(?P<id>(?:functions\.)?(?P<name>[^:<\s]+)(?::\d+)?)\s*<\|tool_call_argument_begin\|>\s*"),
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{arguments}"
    "<|tool_call_end|><|tool_calls_section_end|>")
QWEN3_CODER = ToolFormat(
    "qwen3_coder", "qwen_3_coder", ("<tool_call>",),
    re.compile(r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>\n?"),
    "<tool_call>\n<function={name}>\n{arguments}</function>\n</tool_call>",
    XmlArguments(re.compile(r"\s*<parameter=(?P<key>[^>\n]+)>\n?"), "</parameter>", "</function>",
                 "<parameter={key}>\n{value}\n</parameter>\n"))
GLM45 = ToolFormat(
    "glm45", "glm_4_7", ("<tool_call>",),
    re.compile(r"\s*<tool_call>\s*(?P<name>[^\s<]+)(?=\s|<)"),  # the name ends where a parameter or the end starts
    "<tool_call>{name}\n{arguments}</tool_call>",
    XmlArguments(re.compile(r"\s*<arg_key>\s*(?P<key>[^<]+?)\s*</arg_key>\s*<arg_value>"), "</arg_value>",
                 "</tool_call>", "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"))

# Mistral's tokenizers v11+ (Mistral Small 3.2, Devstral, Magistral): one [TOOL_CALLS] per call; xgrammar has no
# tag for it (structural_tag builds one), and the optional [CALL_ID] is the call's id.
MISTRAL = ToolFormat(
    "mistral", None, ("[TOOL_CALLS]",),
    re.compile(r"\s*\[TOOL_CALLS\]\s*(?P<name>[^\[\s]+)\s*(?:\[CALL_ID\]\s*(?P<id>[^\[\s]+)\s*)?\[ARGS\]\s*"),
    "[TOOL_CALLS]{name}[ARGS]{arguments}")
# Llama-4's (and Llama-3.2's pythonic template): a Python list of calls with keyword arguments; xgrammar has no tag
# for it (structural_tag builds one: each property as key=value, its JSON value where Python reads the same).
PYTHONIC = ToolFormat(
    "pythonic", None, ("[",), re.compile(r"\s*[\[,]\s*(?P<name>[A-Za-z_][\w.\-]*)\("), "[{name}({arguments})]",
    python=True, next_calls=("[", ","))
# The harmony reader (tools/harmony.py) passes every call on in this one spelling, wherever the model put "to=".
GPT_OSS = ToolFormat(
    "gpt_oss", "harmony", ("<|channel|>commentary to=",),
    re.compile(r"\s*<\|channel\|>commentary to=functions\.(?P<name>[^\s<]+) <\|constrain\|>json<\|message\|>"),
    "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}<|call|>")

FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, DEEPSEEK_V3, KIMI_K2, QWEN3_CODER, GLM45, GPT_OSS, MISTRAL,
                               PYTHONIC)}


def detect_format(chat_template: str | None, configured: str = "auto") -> ToolFormat:
    """The configured format, or the one the chat template writes; hermes for templates that write none."""
    if configured != "auto":
        return FORMATS[configured]
    template = chat_template or ""
    if "tool▁calls▁begin" in template or "tool▁call▁begin" in template:
        return DEEPSEEK_V3
    if "<|tool_calls_section_begin|>" in template:
        return KIMI_K2
    if "<|channel|>" in template:
        return GPT_OSS
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "func_name1(" in template:  # the pythonic templates' instruction: [func_name1(params_name1=...), ...]
        return PYTHONIC
    if "<parameter=" in template and "<function=" in template:
        return QWEN3_CODER
    if "<arg_key>" in template:
        return GLM45
    if "<|python_tag|>" in template or '"parameters": ' in template and "ipython" in template:
        return LLAMA3_JSON
    return HERMES


# The longest run of whitespace a call's arguments may hold (JSON indented four levels deep fits): unbounded, a
# model that loops on newlines (a small one under XML parameters does) never ends its call.
MAX_WHITESPACE = 20


def structural_tag(fmt: ToolFormat, tools: list[dict], tool_choice: str | dict, parallel: bool) -> str:
    """xgrammar's structural tag (JSON) constraining the output to ``fmt``'s calls of ``tools``: for auto, free
    text in which any started call is well formed; for required, calls only (at least one; one with ``parallel``
    false); for a named tool, that call only."""
    import xgrammar as xgr

    if fmt.structural_tag_model is None:
        tag = _own_tag(fmt, tools, tool_choice, parallel)
    else:
        tag = json.loads(xgr.get_model_structural_tag(fmt.structural_tag_model, tools=tools, tool_choice=tool_choice,
                                                      reasoning="disabled", parallel_tool_calls=parallel,
                                                      max_whitespace_cnt=MAX_WHITESPACE).model_dump_json())
    body = tag["format"]
    if tool_choice == "required" and body["type"] == "triggered_tags":
        # xgrammar lets text run before, between and after the calls of ``required``; OpenAI's required answers
        # with calls alone, so the calls follow one another, separated by a newline.
        tag["format"] = {"type": "tags_with_separator", "tags": body["tags"], "separator": "\n",
                         "at_least_one": True, "stop_after_first": not parallel}
    return json.dumps(_bounded(tag))


def _own_tag(fmt: ToolFormat, tools: list[dict], tool_choice: str | dict, parallel: bool) -> dict:
    """A structural tag for a format xgrammar has none for: each call is the format's call with the tool's JSON
    arguments (``call_template`` split around ``{arguments}``), triggered by the format's first trigger."""
    begin, end = fmt.call_template.split("{arguments}")
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    chosen = [t["function"] for t in tools if named is None or t["function"]["name"] == named]
    if fmt.python and tool_choice != "auto":  # one list of calls: [f(..), g(..)]
        tags = [{"type": "tag", "begin": f"{f['name']}(", "content": _python_kwargs(f.get("parameters") or {}),
                 "end": ")"} for f in chosen]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
                 "stop_after_first": not parallel or named is not None}
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "const_string", "value": "["}, calls, {"type": "const_string", "value": "]"}]}}
    tags = [{"type": "tag", "begin": begin.format(name=f["name"]),
             "content": _python_kwargs(f.get("parameters") or {}) if fmt.python else
             {"type": "json_schema", "json_schema": f.get("parameters") or {"type": "object"}},
             "end": end.format(name=f["name"])} for f in chosen]
    if tool_choice == "auto":
        body = {"type": "triggered_tags", "triggers": [fmt.triggers[0]], "tags": tags, "at_least_one": False,
                "stop_after_first": not parallel}
    else:
        body = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
                "stop_after_first": not parallel or named is not None}
    return {"type": "structural_tag", "format": body}


def _python_kwargs(schema: dict) -> dict:
    """A schema's properties as Python keyword arguments: the required ones first, then the optional ones (each may
    be left out), separated by ", " (after each, Python's trailing comma, when none is required); a boolean is
    True/False, null is None, any other value its JSON (a string, a number, a list or an object of them: what
    Python reads the same)."""
    required = set(schema.get("required") or ())
    properties = sorted((schema.get("properties") or {}).items(), key=lambda item: item[0] not in required)
    comma = {"type": "const_string", "value": ", "}
    elements = []
    for i, (key, prop) in enumerate(properties):
        kind = prop.get("type") if isinstance(prop, dict) else None
        value = {"type": "json_schema", "json_schema": prop}
        if kind in ("boolean", "null"):
            value = {"type": "regex", "pattern": "True|False"} if kind == "boolean" else \
                {"type": "const_string", "value": "None"}
        parts = [{"type": "const_string", "value": f"{key}="}, value]
        parts = parts + [comma] if not required else ([comma] if i else []) + parts
        member = {"type": "sequence", "elements": parts}
        elements.append(member if key in required else {"type": "optional", "content": member})
    if not elements:
        return {"type": "const_string", "value": ""}
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _bounded(node):
    """xgrammar's Kimi tag lets a call's index run to any number of digits (``\\d+``): a model that loops there
    never ends its call. An index has at most 4 digits here."""
    if isinstance(node, dict):
        if node.get("type") == "regex" and node.get("pattern") == r"\d+":
            return {**node, "pattern": r"\d{1,4}"}
        return {key: _bounded(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_bounded(value) for value in node]
    return node


def arguments_json(arguments: str) -> dict:
    """OpenAI sends past calls' arguments as a JSON string; templates want the object. ValueError if not JSON."""
    value = json.loads(arguments)
    if not isinstance(value, dict):
        raise ValueError("arguments must be a JSON object")
    return value
