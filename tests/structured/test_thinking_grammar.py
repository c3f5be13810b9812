"""A constraint that starts once the thinking closes (tools/thinking.py), judged by xgrammar's own matcher on a
character vocabulary: free text inside the thinking, the constraint after it, for both kinds of reasoning format."""

import json

import pytest
import xgrammar as xgr

from tokenmill.structured.spec import GrammarSpec
from tokenmill.tools.thinking import after_thinking
from tokenmill.tools.formats import HERMES, structural_tag
from tokenmill.tools.reasoning import DEEPSEEK_R1, QWEN3

VOCAB = [chr(i) for i in range(9, 127)] + ["<eos>"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1]))


def complete(compiler, spec: GrammarSpec, text: str) -> bool:
    """Whether ``text`` is a whole output of the grammar (every character accepted, then the end)."""
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(spec.value))
    return all(matcher.accept_token(VOCAB.index(ch)) for ch in text) and matcher.accept_token(len(VOCAB) - 1)


@pytest.mark.parametrize("inner", [GrammarSpec("json_schema", json.dumps(SCHEMA)),
                                   GrammarSpec("regex", r'\{"a": \d+\}'),
                                   GrammarSpec("choice", json.dumps(['{"a": 1}', '{"a": 22}']))])
def test_the_answer_follows_the_constraint_after_the_thinking(compiler, inner):
    r1, qwen3 = after_thinking(inner, DEEPSEEK_R1), after_thinking(inner, QWEN3)
    # R1: the output starts inside the thinking, which may hold anything, even the answer's shape broken.
    assert complete(compiler, r1, 'Let me {think "a": x</think>\n\n{"a": 1}')
    assert not complete(compiler, r1, 'Let me think</think>\n\nnot json')
    assert not complete(compiler, r1, '{"a": 1}')  # the thinking never closed
    # Qwen3: thinking is optional; without it the answer comes at once.
    assert complete(compiler, qwen3, '<think>free {text</think>\n{"a": 1}')
    assert complete(compiler, qwen3, '{"a": 1}')
    assert not complete(compiler, qwen3, '<think>free</think>oops')
    assert not complete(compiler, qwen3, 'oops {"a": 1}')


def test_a_constraint_that_writes_the_thinking_is_kept():
    forced = GrammarSpec("regex", r"<think>[a-z]+</think>\n\n[A-Z][a-z]+")
    assert after_thinking(forced, QWEN3) == forced and after_thinking(forced, DEEPSEEK_R1) == forced


def test_a_forced_tool_call_after_the_thinking(compiler):
    tag = GrammarSpec("structural_tag", structural_tag(HERMES, TOOLS, "required", False))
    r1 = after_thinking(tag, DEEPSEEK_R1)
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>'
    assert complete(compiler, r1, "I should call f. <tool_call> here is only text</think>\n\n" + call)
    assert not complete(compiler, r1, "thinking</think>\n\nno call")
