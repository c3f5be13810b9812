"""The grammar pieces against xgrammar itself, a plain loop and jsonschema: spec validation, the sampler's bitmask
application, draft cutting and per-position masks, the compile cache, and the closing text that steers an output to
its end near max_tokens."""

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from tokenmill.sampling.sampler import apply_grammar_bitmask
from tokenmill.structured.closing import closing_text
from tokenmill.structured.grammar import GrammarCompiler, GrammarError, build_grammar
from tokenmill.structured.matchers import GrammarMatchers
from tokenmill.structured.spec import GrammarSpec


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json_schema", '{"type": "objectx"}'), "objectx"),
    (GrammarSpec("regex", "(a"), "parenthesis"),
    (GrammarSpec("grammar", 'root ::= "a" |'), "Expect element"),
    (GrammarSpec("choice", "[]"), "non-empty"),
    (GrammarSpec("structural_tag", '{"type": "nope"}'), "structural_tag"),
])
def test_bad_specs_raise_grammar_error(spec, words):
    with pytest.raises(GrammarError, match=words):
        build_grammar(spec)


def test_bitmask_application_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32: the last word's high bits lie past the vocabulary
    bitmask = rng.integers(-2**31, 2**31, size=(2, 3), dtype=np.int64).astype(np.int32)
    logits = torch.randn(3, vocab)
    expected = logits.clone()
    for i, row in enumerate([0, 2]):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_grammar_bitmask(logits, torch.tensor([0, 2]), torch.from_numpy(bitmask))
    assert torch.equal(logits, expected)


@pytest.fixture(scope="module")
def matchers(smollm_llm):
    tok = smollm_llm.tokenizer.hf
    return GrammarMatchers(GrammarCompiler(tok, len(tok), [tok.eos_token_id]), len(tok), smollm_llm.tokenizer,
                           [tok.eos_token_id])


def test_drafts_are_cut_and_masked_per_position(matchers, smollm_llm):
    encode = smollm_llm.tokenizer.hf.encode
    matchers.add("r", GrammarSpec("regex", r"ab+c"))
    a, b, c, x = (encode(s)[0] for s in "abcx")
    assert matchers.valid_drafts("r", [a, b, x, c]) == [a, b]  # cut at the first token the grammar refuses
    masks = matchers.bitmask("r", [a, b])
    reference = xgr.GrammarMatcher(matchers.compiler.compile(GrammarSpec("regex", r"ab+c")))
    for j, token in enumerate([a, b, None]):  # the mask after j drafts is a fresh matcher's after those tokens
        row = xgr.allocate_token_bitmask(1, matchers.width * 32).numpy()[:, :matchers.width]
        reference.fill_next_token_bitmask(row)
        assert np.array_equal(masks[j], row[0])
        if token is not None:
            reference.accept_token(token)
    assert not matchers.accept("r", [a, b, b]) and matchers.accept("r", [c, smollm_llm.tokenizer.eos_token_id])
    matchers.remove("r")


def test_compile_cache_is_keyed_by_spec(matchers):
    before = matchers.compiler.num_compiled
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    for _ in range(3):
        matchers.compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert matchers.compiler.num_compiled == before + 1


NESTED = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "home": {"type": "object", "properties": {"city": {"type": "string", "minLength": 2}, "geo": {"type": "number"}},
             "required": ["city", "geo"]}, "pet": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["name", "age", "tags", "home", "pet"]}


@pytest.mark.parametrize("prefix", ['', '{"name": "Jo', '{"name": "Jo", "age": 12',
                                    '{"name": "Jo", "age": 1, "tags": [', '{"name": "Jo", "age": 1, "tags": ["a", "b',
                                    '{"name": "", "age": 1, "tags": [], "home": {"city": "x'])
def test_closing_text_completes_a_json_document(matchers, smollm_llm, prefix):
    matcher = xgr.GrammarMatcher(matchers.compiler.compile(GrammarSpec("json_schema", json.dumps(NESTED))))
    assert matcher.accept_string(prefix)
    text = closing_text(matcher, prefix, matchers._decode_one, matchers.width, matchers.stop_token_ids)
    jsonschema.validate(json.loads(prefix + text), NESTED)
    assert matcher.accept_string(text) and matcher.is_completed()  # closing_text left the matcher as it was


@pytest.mark.parametrize("spec, prefix, pattern", [
    (GrammarSpec("regex", r"[A-Z][a-z]{2,8}!"), "Q", r"[A-Z][a-z]{2,8}!"),
    (GrammarSpec("choice", json.dumps(["Paris", "London"])), "Lo", r"London"),
])
def test_closing_text_completes_other_grammars(matchers, spec, prefix, pattern):
    matcher = xgr.GrammarMatcher(matchers.compiler.compile(spec))
    assert matcher.accept_string(prefix)
    text = closing_text(matcher, prefix, matchers._decode_one, matchers.width, matchers.stop_token_ids)
    assert re.fullmatch(pattern, prefix + text)
