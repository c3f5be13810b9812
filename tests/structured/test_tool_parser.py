"""Tool calls read back out of text in each format: whole, and streamed in every split of the text, the deltas
reassemble into exactly the whole parse (json.loads is the judge of the arguments)."""

import json
import random

import pytest

from tokenmill.tools.formats import (DEEPSEEK_V3, GLM45, HERMES, KIMI_K2, LLAMA3_JSON, MISTRAL, PYTHONIC,
                                     QWEN3_CODER, detect_format)
from tokenmill.tools.parser import ToolCallParser, parse_tool_calls

ARGS = [{"city": "Paris", "note": "say \"hi\" {not a brace} \\ ok"}, {"q": [1, {"a": "}"}], "e": None}]
CASES = {
    "hermes": (HERMES, "Let me check.\n" + "\n".join(
        f'<tool_call>\n{{"name": "f{i}", "arguments": {json.dumps(a)}}}\n</tool_call>' for i, a in enumerate(ARGS))),
    "llama3_json": (LLAMA3_JSON, "<|python_tag|>" + "; ".join(
        f'{{"name": "f{i}", "parameters": {json.dumps(a)}}}' for i, a in enumerate(ARGS))),
    "deepseek_v3": (DEEPSEEK_V3, "Let me check.<｜tool▁calls▁begin｜>" + "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>f{i}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
        for i, a in enumerate(ARGS)) + "<｜tool▁calls▁end｜>"),
    "kimi_k2": (KIMI_K2, "Let me check.<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.f{i}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        for i, a in enumerate(ARGS)) + "<|tool_calls_section_end|>"),
    "qwen3_coder": (QWEN3_CODER, "Let me check.\n" + "\n".join(
        QWEN3_CODER.render_call(f"f{i}", json.dumps(a)) for i, a in enumerate(ARGS))),
    "glm45": (GLM45, "Let me check.\n" + "\n".join(
        GLM45.render_call(f"f{i}", json.dumps(a)) for i, a in enumerate(ARGS))),
    "mistral": (MISTRAL, "Let me check." + "".join(MISTRAL.render_call(f"f{i}", json.dumps(a))
                                                   for i, a in enumerate(ARGS))),
    "pythonic": (PYTHONIC, "Let me check. [" + ", ".join(PYTHONIC.render_call(f"f{i}", json.dumps(a))[1:-1]
                                                          for i, a in enumerate(ARGS)) + "]"),
}
CONTENT = {"llama3_json": "", "hermes": "Let me check.\n", "qwen3_coder": "Let me check.\n",
           "glm45": "Let me check.\n", "pythonic": "Let me check. "}
# The XML formats type each parameter by its schema (what is not a string is read as JSON).
SCHEMAS = {"f0": {"properties": {"city": {"type": "string"}, "note": {"type": "string"}}},
           "f1": {"properties": {"q": {"type": "array"}, "e": {"type": ["null", "integer"]}}}}


@pytest.mark.parametrize("name", CASES)
def test_whole_parse(name):
    fmt, text = CASES[name]
    content, calls = parse_tool_calls(fmt, text, SCHEMAS)
    assert content == CONTENT.get(name, "Let me check.")
    assert [c.name for c in calls] == ["f0", "f1"]
    assert [json.loads(c.arguments) for c in calls] == ARGS
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seed", range(5))
def test_streamed_deltas_reassemble(name, seed):
    fmt, text = CASES[name]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 25))
    parser, content, calls = ToolCallParser(fmt, SCHEMAS), "", {}
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        c, deltas = parser.feed(text[a:b])
        content += c
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.arguments == ""  # id and name come first, alone
                calls[d.index] = [d.name, ""]
            else:
                calls[d.index][1] += d.arguments
    content += parser.finish()[0]
    whole_content, whole = parse_tool_calls(fmt, text, SCHEMAS)
    assert content == whole_content
    assert [tuple(v) for v in calls.values()] == [(c.name, c.arguments) for c in whole]


def test_plain_text_is_content_even_with_a_trigger_in_it():
    text = "Use <tool_call> tags when you call a tool; I will not now." + " more" * 60
    assert parse_tool_calls(HERMES, text) == (text, [])
    held = ToolCallParser(HERMES)
    assert held.feed("Hello <tool")[0] == "Hello "  # a possible trigger start is held back...
    assert held.finish()[0] == "<tool"  # ...and released when the output ends


def test_format_detection():
    assert detect_format("{{ '<|python_tag|>' }}") is LLAMA3_JSON
    assert detect_format("{{'<｜tool▁calls▁begin｜>'}}") is DEEPSEEK_V3
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is HERMES
    assert detect_format(None, "llama3_json") is LLAMA3_JSON
    assert detect_format("{{ '<|tool_calls_section_begin|>' }}") is KIMI_K2
    assert detect_format("<function={{ name }}>\n<parameter={{ key }}>") is QWEN3_CODER
    assert detect_format("<arg_key>{{ k }}</arg_key>") is GLM45
    assert detect_format("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}") is MISTRAL
    assert detect_format("[func_name1(params_name1=params_value1, ...)]") is PYTHONIC


def test_mistral_call_ids_come_from_call_id():
    text = '[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x": 1}'
    assert [(c.id, c.name, c.arguments) for c in parse_tool_calls(MISTRAL, text)[1]] == [("a1b2c3d4e", "f", '{"x": 1}')]


def test_xml_parameters_are_typed_by_the_schema():
    text = QWEN3_CODER.render_call("f", json.dumps({"n": 3, "s": "3", "flag": True, "free": "x"}))
    schemas = {"f": {"properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "flag": {"type": "boolean"}}}}
    assert json.loads(parse_tool_calls(QWEN3_CODER, text, schemas)[1][0].arguments) == \
        {"n": 3, "s": "3", "flag": True, "free": "x"}
    cut = ToolCallParser(QWEN3_CODER, schemas)  # an output cut inside a call still gives an object
    cut.feed("<tool_call>\n<function=f>\n<parameter=n>\n4\n</parameter>\n")
    cut.finish()
    assert json.loads(cut.calls[0].arguments) == {"n": 4}


def test_kimi_ids_are_the_headers():
    _, calls = parse_tool_calls(KIMI_K2, CASES["kimi_k2"][1])
    assert [c.id for c in calls] == ["functions.f0:0", "functions.f1:1"]


@pytest.mark.parametrize("name", CASES)
def test_the_forcing_grammar_accepts_what_the_format_writes_and_the_parser_reads(name, smollm_llm):
    """xgrammar's structural tag (tool_choice required), our rendering of a call and our parser agree."""
    import xgrammar as xgr

    from tokenmill.structured.spec import GrammarSpec
    from tokenmill.tools.formats import structural_tag

    fmt = CASES[name][0]
    tools = [{"type": "function", "function": {"name": "f0", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    compiler = smollm_llm.engine.grammars.matchers.compiler
    matcher = xgr.GrammarMatcher(compiler.compile(GrammarSpec("structural_tag",
                                                              structural_tag(fmt, tools, "required", True))))
    text = fmt.render_call("f0", json.dumps({"city": "Paris"}))
    assert matcher.accept_string(text)
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(fmt, text)[1]] == [("f0", {"city": "Paris"})]
    assert not xgr.GrammarMatcher(compiler.compile(GrammarSpec(
        "structural_tag", structural_tag(fmt, tools, "required", True)))).accept_string("Sure! " + text)


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_required_means_calls_only(name, smollm_llm):
    """xgrammar's tags for tool_choice required let text run around the calls; ours allow calls alone, one after
    another (one only without parallel_tool_calls)."""
    import xgrammar as xgr

    from tokenmill.structured.spec import GrammarSpec
    from tokenmill.tools.formats import structural_tag

    fmt = CASES[name][0]
    tools = [{"type": "function", "function": {"name": "f0", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = fmt.render_call("f0", json.dumps({"city": "Paris"}))
    compiler = smollm_llm.engine.grammars.matchers.compiler

    def accepts(text: str, parallel: bool) -> bool:
        spec = GrammarSpec("structural_tag", structural_tag(fmt, tools, "required", parallel))
        matcher = xgr.GrammarMatcher(compiler.compile(spec))
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(call, True) and accepts(call + "\n" + call, True)
    assert not accepts(call + "\n" + call, False)
    assert not accepts(call + " And that is all.", True)


@pytest.mark.parametrize("name", CASES)
def test_one_character_at_a_time(name):
    fmt, text = CASES[name]
    parser = ToolCallParser(fmt, SCHEMAS)
    names = [d.name for ch in text for d in parser.feed(ch)[1] if d.id is not None]
    parser.finish()
    assert names == ["f0", "f1"] and [json.loads(c.arguments) for c in parser.calls] == ARGS
