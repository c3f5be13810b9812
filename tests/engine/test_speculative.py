"""Speculative decoding (n-gram prompt lookup) on SmolLM2, fp32: greedy and seeded outputs are token for token those
of decoding without it, whatever else the request asks (penalties, stops, min_tokens, max_tokens, logprobs, n);
on tiny GQA and MLA models through preemption and abort; unseeded sampling keeps the target distribution.

The SmolLM2 tests draft on the session's engine (``drafting``: its proposer set for the duration), so the weights
load once; the tiny-model tests turn speculation on through the configuration."""

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.runner import accept
from tokenmill.sampling.metadata import SamplingMetadata
from tokenmill.sampling.sampler import Sampler
from tokenmill.speculative.ngram import NgramProposer

PASSAGE = ("The river Thames flows through London. It passes Westminster, the Tower and Greenwich before it "
           "reaches the sea. Boats have carried goods along it for two thousand years.")
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@contextlib.contextmanager
def drafting(llm: LLM):
    """``llm`` with n-gram drafts (4 per step, n-grams of 3 down to 1 token), as --speculative-method ngram sets."""
    runner = llm.engine.runner
    assert runner.proposer is None
    runner.proposer = NgramProposer(4, min_n=1, max_n=3)
    try:
        yield llm
    finally:
        runner.proposer = None


@pytest.fixture(scope="module")
def copy_prompts(smollm_llm, prompt_ids):
    chat = smollm_llm.tokenizer.apply_chat_template
    return [chat([{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]),
            chat([{"role": "user", "content": f"Summarize in one sentence, quoting it:\n\n{PASSAGE}"}]),
            *prompt_ids[2:5]]


def same_outputs(llm: LLM, prompts, params: SamplingParams):
    a = llm.generate(prompts, params)
    with drafting(llm):
        b = llm.generate(prompts, params)
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert (cy.token_ids, cy.text, cy.finish_reason, cy.stop_reason) == \
                (cx.token_ids, cx.text, cx.finish_reason, cx.stop_reason)
    return a, b


def test_greedy_outputs_are_identical_and_drafts_are_accepted(smollm_llm, copy_prompts):
    params = dataclasses.replace(GREEDY, logprobs=2)
    before = smollm_llm.engine.stats()
    same_outputs(smollm_llm, copy_prompts[:1], params)  # the model copies PASSAGE, then rambles
    stats = smollm_llm.engine.stats()
    drafted = stats.spec_num_draft_tokens_total - before.spec_num_draft_tokens_total
    accepted = stats.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total
    assert drafted > 0 and accepted > 0.4 * drafted
    plain, spec = same_outputs(smollm_llm, copy_prompts, params)
    for x, y in zip(plain, spec):
        assert [lp for lp, _ in y.logprobs] == pytest.approx([lp for lp, _ in x.logprobs], abs=1e-3)
        assert [[t for t, _ in top] for _, top in y.logprobs] == [[t for t, _ in top] for _, top in x.logprobs]
    stats = smollm_llm.engine.stats()
    assert stats.spec_drafted_by_position[0] >= stats.spec_drafted_by_position[-1]
    assert all(a <= d for a, d in zip(stats.spec_accepted_by_position, stats.spec_drafted_by_position))


def run_batch(llm: LLM, items: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
    """Every (prompt, params) request in one batch: (token ids, text, finish reason, stop reason) of each."""
    ids = [llm.add_request(prompt, params) for prompt, params in items]
    got = {rid: ([], "", None, None) for rid in ids}
    while llm.engine.has_unfinished():
        for out in llm.engine.step().outputs:
            tokens, text, _, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, text + out.delta_text, out.finish_reason,
                                   out.stop_reason)
    return [got[rid] for rid in ids]


def test_composes_with_seeds_penalties_bias_stops_and_token_limits(smollm_llm, copy_prompts):
    """One batch of requests, each with another parameter, equal with and without drafts."""
    full = smollm_llm.generate(copy_prompts[:1], GREEDY)[0]
    natural = dataclasses.replace(GREEDY, ignore_eos=False, max_tokens=120)
    eos_after = len(smollm_llm.generate(copy_prompts[:1], natural)[0].token_ids)
    assert eos_after < 120  # the copy ends with EOS
    variants = [  # (copy prompt, parameters); the stops were read from copy prompt 0's output
        (0, dict(temperature=0.7, top_p=0.95, seed=123)), (1, dict(temperature=1.0, top_k=20, seed=7)),
        (1, dict(repetition_penalty=1.3)), (0, dict(frequency_penalty=0.8, presence_penalty=0.5)),
        (1, dict(logit_bias={13: 5.0})), (0, dict(max_tokens=7)), (1, dict(max_tokens=1)),
        (0, dict(stop=[full.text[40:46]])), (0, dict(stop_token_ids=[full.token_ids[20]])),
        (0, dict(ignore_eos=False, max_tokens=120)), (0, dict(ignore_eos=False, max_tokens=120,
                                                             min_tokens=eos_after + 3))]
    items = [(copy_prompts[i], dataclasses.replace(GREEDY, **v)) for i, v in variants]
    plain = run_batch(smollm_llm, items)
    with drafting(smollm_llm):
        spec = run_batch(smollm_llm, items)
    assert spec == plain
    assert plain[7][2:] == ("stop", full.text[40:46]) and plain[8][2:] == ("stop", full.token_ids[20])
    assert plain[9][2] == "stop" and len(plain[10][0]) >= eos_after + 3


def test_verification_keeps_the_target_distribution():
    """Drafts without a distribution (n-gram) are accepted with probability p(draft); a rejection emits a token
    from p without the draft. So the first emitted token is distributed as p, whatever the draft."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 40_000
    logits = p.log().repeat(rows, 1)
    meta = SamplingMetadata(temperature=torch.ones(rows), random_rows=torch.arange(rows))
    first = np.array(Sampler(seed=1).sample(logits.clone(), meta).token_ids.tolist())
    for draft in (0, 3):
        emitted = np.array([accept([draft], [int(t), -1])[0] for t in first])
        freq = np.bincount(emitted, minlength=4) / rows
        assert freq == pytest.approx(p.numpy(), abs=0.01)
        assert (emitted == draft).mean() == pytest.approx(float(p[draft]), abs=0.01)  # acceptance = p(draft)


@pytest.mark.parametrize("kind", ["dense-gqa", "v2-lite-like"])
def test_tiny_gqa_and_mla_models_through_preemption_and_abort(tmp_path, smollm_llm, kind):
    """GQA and MLA (+ MoE) verify drafts through their chunked-prefill attention: greedy tokens are unchanged, also
    when a pool too small for all requests preempts some; an abort mid-draft frees every block."""
    from tests.tiny_checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, smollm_llm, kind)
    common = dict(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32")
    prompts = [[(5 * i) % 7 + 100 for i in range(n)] for n in (9, 20, 33)]  # periodic: drafts to verify
    params = dataclasses.replace(GREEDY, max_tokens=24)
    plain = LLM(**common, kv_cache_memory="8MiB")
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    need = [len(p) + params.max_tokens for p in prompts]
    capacity = max(max(need) + 16, sum(need) * 2 // 3) // 16 * 16  # one request always fits, all never do
    kv_bytes = plain.engine.info.kv_bytes_per_token
    tight = LLM(**common, max_model_len=capacity, kv_cache_memory=(capacity + 16) * kv_bytes,  # + the null block
                speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    engine = tight.engine
    assert [r.token_ids for r in tight.generate(prompts, params)] == expected
    assert engine.scheduler.num_preemptions_total >= 1 and engine.stats().spec_num_accepted_tokens_total > 0
    rid = tight.add_request(prompts[2], params)
    drafted = engine.stats().spec_num_draft_tokens_total
    while engine.stats().spec_num_draft_tokens_total == drafted:  # until a step has verified drafts
        engine.step()
    assert engine.abort(rid) is not None
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks
