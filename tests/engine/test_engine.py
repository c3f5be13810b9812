"""End-to-end engine behaviour on SmolLM2: preemption, seeded sampling, stop conditions, logprobs."""

import dataclasses

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.messages import ContextLengthError

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def short_answer_ids(smollm_llm):
    """A chat turn SmolLM2 answers in a few tokens, then emits EOS (<|im_end|>)."""
    return smollm_llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])


def test_preemption_gives_identical_outputs_and_frees_pool(smollm_llm, prompt_ids):
    short = prompt_ids[:4]  # 4 prompts; each needs < 256 tokens, all together far more than 320
    expected = [r.token_ids for r in smollm_llm.generate(short, GREEDY)]
    kv_bytes_per_token = smollm_llm.engine.info.kv_bytes_per_token
    tight = LLM(dtype="float32", kv_cache_dtype="fp32", block_size=16, max_model_len=320,
                kv_cache_memory=(320 + 16) * kv_bytes_per_token)  # + the null block
    engine = tight.engine
    assert engine.scheduler.kv.capacity_tokens == 320
    assert sum(len(p) + GREEDY.max_tokens for p in short) > 320
    results = tight.generate(short, GREEDY)
    assert engine.scheduler.num_preemptions_total >= 1
    assert [r.token_ids for r in results] == expected
    pool = engine.scheduler.kv.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_seeded_sampling_is_batch_invariant(smollm_llm, prompt_ids):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=32, ignore_eos=True)
    alone = smollm_llm.generate([prompt_ids[1]], params)[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    engine = smollm_llm.engine
    # The same seeded request in a crowd of unseeded ones, admitted in the middle.
    for i in (0, 2):
        smollm_llm.add_request(prompt_ids[i], others)
    seeded = smollm_llm.add_request(prompt_ids[1], params)
    smollm_llm.add_request(prompt_ids[3], others)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step().outputs if o.request_id == seeded for t in o.new_token_ids]
    assert tokens == alone
    again = smollm_llm.generate([prompt_ids[1]], dataclasses.replace(params, seed=99))[0].token_ids
    assert again != alone  # the seed matters


def test_unseeded_sampling_varies(smollm_llm, prompt_ids):
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=3)
    outs = smollm_llm.generate([prompt_ids[2]], params)[0].outputs
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stop_string_spanning_tokens_is_cut(smollm_llm, prompt_ids):
    tok = smollm_llm.tokenizer
    full = smollm_llm.generate([prompt_ids[3]], GREEDY)[0]
    pieces = [tok.decode([t]) for t in full.token_ids]
    # Find a boundary between two tokens with at least 2 visible chars each, well inside the output.
    k = next(i for i in range(5, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    cut = full.text.index(stop)
    result = smollm_llm.generate([prompt_ids[3]], dataclasses.replace(GREEDY, stop=[stop, "never-appears-xyz"]))[0]
    assert result.finish_reason == "stop"
    assert result.outputs[0].stop_reason == stop
    assert result.text == full.text[:cut]
    assert stop not in result.text


def test_stream_deltas_never_leak_a_stop_string(smollm_llm, prompt_ids):
    full = smollm_llm.generate([prompt_ids[3]], GREEDY)[0]
    stop = full.text[30:36]
    engine = smollm_llm.engine
    req = smollm_llm.add_request(prompt_ids[3], dataclasses.replace(GREEDY, stop=[stop]))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.delta_text for o in engine.step().outputs if o.request_id == req]
    assert "".join(deltas) == full.text[:full.text.index(stop)]


def test_stop_token_ids_eos_and_max_tokens(smollm_llm, prompt_ids, short_answer_ids):
    full = smollm_llm.generate([prompt_ids[2]], GREEDY)[0]
    stop_token = full.token_ids[7]
    r = smollm_llm.generate([prompt_ids[2]], dataclasses.replace(GREEDY, stop_token_ids=[stop_token]))[0]
    first = full.token_ids.index(stop_token)
    assert r.token_ids == full.token_ids[:first + 1] and r.finish_reason == "stop"
    assert r.outputs[0].stop_reason == stop_token
    r = smollm_llm.generate([prompt_ids[2]], dataclasses.replace(GREEDY, max_tokens=5))[0]
    assert r.token_ids == full.token_ids[:5] and r.finish_reason == "length"
    # Without ignore_eos the chat answer ends at the EOS token <|im_end|>, which the text leaves out.
    r = smollm_llm.generate([short_answer_ids], dataclasses.replace(GREEDY, ignore_eos=False, max_tokens=200))[0]
    assert r.finish_reason == "stop" and r.token_ids[-1] == smollm_llm.tokenizer.eos_token_id
    assert "<|im_end|>" not in r.text


def test_min_tokens_suppresses_eos(smollm_llm, short_answer_ids):
    natural = smollm_llm.generate([short_answer_ids], dataclasses.replace(GREEDY, ignore_eos=False))[0]
    assert natural.finish_reason == "stop"
    n = len(natural.token_ids)
    r = smollm_llm.generate([short_answer_ids], dataclasses.replace(GREEDY, ignore_eos=False, min_tokens=n + 5,
                                                                 max_tokens=n + 10))[0]
    assert len(r.token_ids) >= n + 5
    assert smollm_llm.tokenizer.eos_token_id not in r.token_ids[:n + 4]


def test_logprobs_match_transformers(smollm_llm, smollm_hf, prompt_ids):
    model, _ = smollm_hf
    ids = prompt_ids[2]
    r = smollm_llm.generate([ids], dataclasses.replace(GREEDY, max_tokens=3, logprobs=5))[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids + r.token_ids])).logits[0].log_softmax(-1)
    for step, (lp, top) in enumerate(r.logprobs):
        row = ref[len(ids) - 1 + step]
        assert lp == pytest.approx(float(row[r.token_ids[step]]), abs=1e-3)
        values, indices = row.topk(5)
        assert [t for t, _ in top] == indices.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-3)


def test_logit_bias_and_penalties_change_greedy_choice(smollm_llm, prompt_ids):
    base = smollm_llm.generate([prompt_ids[2]], GREEDY)[0].token_ids
    banned = smollm_llm.generate([prompt_ids[2]], dataclasses.replace(GREEDY, logit_bias={base[0]: -100}))[0]
    assert banned.token_ids[0] != base[0]
    forced = smollm_llm.generate([prompt_ids[2]], dataclasses.replace(GREEDY, logit_bias={42: 100}, max_tokens=4))[0]
    assert forced.token_ids == [42] * 4
    # A raw prompt that greedy decoding keeps repeating; the penalties must break the loop.
    loop = smollm_llm.tokenizer.encode("apple apple apple apple apple apple apple apple")
    plain = smollm_llm.generate([loop], dataclasses.replace(GREEDY, max_tokens=12))[0].token_ids
    apple = max(set(plain), key=plain.count)
    assert plain.count(apple) >= 6
    for penalty in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        out = smollm_llm.generate([loop], dataclasses.replace(GREEDY, max_tokens=12, **penalty))[0].token_ids
        assert out.count(apple) < plain.count(apple), penalty


def test_text_equals_decode_of_tokens(smollm_llm, prompt_ids):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=48, ignore_eos=True)
    for r in smollm_llm.generate(prompt_ids, params):
        assert r.text == smollm_llm.tokenizer.decode(r.token_ids)


def test_bad_input_is_rejected_and_engine_stays_usable(smollm_llm, prompt_ids):
    engine = smollm_llm.engine
    with pytest.raises(ContextLengthError):
        smollm_llm.add_request(prompt_ids[0], SamplingParams(max_tokens=engine.info.max_model_len))
    with pytest.raises(ValueError, match="prompt"):
        smollm_llm.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="prompt"):
        smollm_llm.add_request([10**9], SamplingParams())
    with pytest.raises(ValueError, match="logit_bias"):
        smollm_llm.add_request(prompt_ids[0], SamplingParams(logit_bias={10**9: 1.0}))
    assert not engine.has_unfinished()
    assert smollm_llm.generate([prompt_ids[0]], dataclasses.replace(GREEDY, max_tokens=2))[0].token_ids


def test_abort_frees_blocks(smollm_llm, prompt_ids):
    engine = smollm_llm.engine
    rid = smollm_llm.add_request(prompt_ids[4], GREEDY)
    engine.step()
    req = engine.scheduler.requests[rid]
    assert req.block_tables
    out = engine.abort(rid)
    assert out.finish_reason == "abort" and req.block_tables == []
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
