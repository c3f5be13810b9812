"""Structured outputs on SmolLM2 (fp32): every constrained output is judged by an independent checker (jsonschema, re,
json) -- greedy and seeded rows, mixed in one batch with unconstrained rows that must not notice, with n-gram drafts,
under ignore_eos and under max_tokens."""

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from tokenmill import SamplingParams
from tokenmill.structured.spec import GrammarSpec
from tests.engine.test_speculative import drafting

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
                         "nickname": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]}},
          "required": ["name", "age", "color", "pets", "nickname"]}
SCHEMA = GrammarSpec("json_schema", json.dumps(PERSON))
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, favourite color, pets, nickname."}]


@pytest.fixture(scope="module")
def ask_ids(smollm_llm):
    return smollm_llm.tokenizer.apply_chat_template(ASK)


def constrained(max_tokens=120, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, grammar=SCHEMA, **{"temperature": 0.0, **kw})


def test_outputs_validate_in_a_mixed_batch(smollm_llm, ask_ids, prompt_ids):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = smollm_llm.generate([prompt_ids[0]], free)[0].outputs[0].token_ids
    params = [constrained(), constrained(temperature=1.0, seed=7), constrained(temperature=1.0, seed=8), free]
    outs = smollm_llm.generate([ask_ids, ask_ids, ask_ids, prompt_ids[0]], params)
    for out in outs[:3]:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
        assert out.outputs[0].finish_reason == "stop"
    assert outs[3].outputs[0].token_ids == alone  # an unconstrained neighbour is untouched


def test_choice_regex_and_json_object(smollm_llm):
    ids = smollm_llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? "
                                                     "Answer as a JSON object with the key capital."}])
    specs = [GrammarSpec("choice", json.dumps(["Paris", "Rome", "Berlin"])), GrammarSpec("regex", r"[A-Z][a-z]{2,8}"),
             GrammarSpec("json_object")]
    outs = smollm_llm.generate([ids] * 3, [SamplingParams(temperature=0.0, max_tokens=80, grammar=s)
                                               for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("Paris", "Rome", "Berlin")
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", texts[1])
    assert isinstance(json.loads(texts[2]), dict) and outs[2].outputs[0].finish_reason == "stop"


def test_drafts_change_nothing(smollm_llm, ask_ids):
    params = [constrained(), constrained(temperature=1.0, seed=3)]
    plain = [o.outputs[0].token_ids for o in smollm_llm.generate([ask_ids] * 2, params)]
    with drafting(smollm_llm):
        drafted = [o.outputs[0].token_ids for o in smollm_llm.generate([ask_ids] * 2, params)]
    assert drafted == plain


def test_ignore_eos_still_ends_at_the_grammars_end(smollm_llm, ask_ids):
    out = smollm_llm.generate([ask_ids], constrained(ignore_eos=True, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm_llm.engine.model_config.eos_token_ids
    jsonschema.validate(json.loads(out.text), PERSON)


@pytest.mark.parametrize("max_tokens", [30, 45, 60])
def test_near_max_tokens_the_output_is_steered_to_a_complete_document(smollm_llm, ask_ids, max_tokens):
    """SmolLM2 lists pets until it runs out of tokens; near max_tokens the engine forces the shortest way out."""
    schema = {**PERSON, "properties": {**PERSON["properties"], "pets": {"type": "array", "items": {"type": "string"}}}}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    for params in (SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=spec),
                   SamplingParams(temperature=1.0, seed=9, max_tokens=max_tokens, grammar=spec)):
        out = smollm_llm.generate([ask_ids], params)[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) <= max_tokens
        jsonschema.validate(json.loads(out.text), schema)


def test_when_even_the_shortest_document_does_not_fit_it_is_length_and_a_valid_prefix(smollm_llm, ask_ids):
    """The smallest PERSON document takes about 27 tokens: with 6 the output is cut, finish_reason "length" (the
    SDK's parse() raises LengthFinishReasonError, as with OpenAI), and every token of it is one the grammar accepts."""
    out = smollm_llm.generate([ask_ids], constrained(max_tokens=6))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    compiler = smollm_llm.engine.grammars.matchers.compiler
    matcher = xgr.GrammarMatcher(compiler.compile(SCHEMA))
    assert all(matcher.accept_token(t) for t in out.token_ids) and not matcher.is_terminated()


def test_grammars_are_compiled_once_per_spec(smollm_llm, ask_ids):
    compiler = smollm_llm.engine.grammars.matchers.compiler
    spec = GrammarSpec("regex", r"(yes|no)")
    before = compiler.num_compiled
    smollm_llm.generate([ask_ids] * 2, SamplingParams(temperature=0.0, max_tokens=4, grammar=spec))
    smollm_llm.generate([ask_ids], SamplingParams(temperature=0.0, max_tokens=4, grammar=GrammarSpec("regex",
                                                                                                    r"(yes|no)")))
    assert compiler.num_compiled == before + 1


def test_a_bad_grammar_is_refused_and_nothing_is_queued(smollm_llm, ask_ids):
    with pytest.raises(ValueError, match="parenthesis"):
        smollm_llm.generate([ask_ids], SamplingParams(max_tokens=4, grammar=GrammarSpec("regex", "(")))
    assert not smollm_llm.engine.has_unfinished()


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json"])
def test_forced_parallel_tool_calls_near_max_tokens_keep_every_call_whole(smollm_llm, fmt_name):
    """SmolLM2 repeats calls when it may make several; near max_tokens it stops between calls rather than start one
    it cannot finish, so every call it returns has arguments that validate."""
    from tokenmill.tools.formats import FORMATS, structural_tag
    from tokenmill.tools.parser import parse_tool_calls
    from tokenmill.tools.prompt import render_messages

    fmt = FORMATS[fmt_name]
    params = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": params}}]
    ids = smollm_llm.tokenizer.apply_chat_template(render_messages(
        [{"role": "user", "content": "What time is it in Paris, Rome and Tokyo?"}], tools, fmt, native=False))
    spec = GrammarSpec("structural_tag", structural_tag(fmt, tools, "required", parallel=True))
    outs = smollm_llm.generate([ids] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=60, grammar=spec)
                                           for s in range(3)])
    for out in outs:
        content, calls = parse_tool_calls(fmt, out.outputs[0].text)
        assert calls and content == ""
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), params)


def test_a_grammar_whose_work_runs_past_its_budget_ends_alone(smollm_llm, prompt_ids, monkeypatch):
    """``(a+)+`` repeated 200 times is a valid regex that compiles in milliseconds, and every "a" it accepts makes
    xgrammar's matcher slower. With a 0.3 s budget for one step's grammar work its request ends with an error, while a
    normal request in the same batch gets exactly the tokens it gets alone, and no step waits for the grammar."""
    import time

    engine = smollm_llm.engine
    monkeypatch.setattr(engine.grammars, "timeout_s", 0.3)
    free = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    alone = smollm_llm.generate([prompt_ids[2]], free)[0].token_ids
    ids = smollm_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say a"}])
    bad = smollm_llm.add_request(ids, SamplingParams(temperature=0.0, max_tokens=400,
                                                     grammar=GrammarSpec("regex", "(a+)+" * 200)))
    normal = smollm_llm.add_request(prompt_ids[2], free)
    tokens, outcome, slowest = {bad: [], normal: []}, {}, 0.0
    while engine.has_unfinished():
        start = time.monotonic()
        outputs = engine.step().outputs
        slowest = max(slowest, time.monotonic() - start)
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                outcome[out.request_id] = (out.finish_reason, out.error)
    assert tokens[normal] == alone and outcome[normal] == ("length", None)
    assert outcome[bad][0] == "error" and "grammar_timeout" in outcome[bad][1]
    assert set(smollm_llm.tokenizer.decode(tokens[bad])) <= {"a"} and len(tokens[bad]) < 400
    assert slowest < 2.0  # a step takes ~0.05 s; the grammar's work took longer than 0.3 s, off the loop
    assert bad not in engine.grammars and not engine.grammars.busy
