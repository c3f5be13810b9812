"""SmolLM2 through tokenmill equals transformers on the same dequantized weights (fp32, fp32 KV cache)."""

import dataclasses

import pytest

from tests.conftest import hf_greedy
from tokenmill import SamplingParams

NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_outputs(smollm_hf, prompt_ids):
    model, _ = smollm_hf
    return [hf_greedy(model, ids, NEW_TOKENS) for ids in prompt_ids]


def test_prompt_lengths_vary(prompt_ids):
    lengths = sorted(len(p) for p in prompt_ids)
    assert lengths[0] < 40 and lengths[-1] > 150, lengths


def test_each_alone(smollm_llm, prompt_ids, hf_outputs):
    for ids, expected in zip(prompt_ids, hf_outputs):
        assert smollm_llm.generate([ids], GREEDY)[0].token_ids == expected


def test_all_in_one_batch(smollm_llm, prompt_ids, hf_outputs):
    results = smollm_llm.generate(prompt_ids, GREEDY)
    assert [r.token_ids for r in results] == hf_outputs


def test_small_step_budget_chunks_prefills(smollm_llm, prompt_ids, hf_outputs):
    scheduler = smollm_llm.engine.scheduler
    saved = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = 16
    try:
        results = smollm_llm.generate(prompt_ids, GREEDY)
    finally:
        scheduler.max_num_batched_tokens = saved
    assert [r.token_ids for r in results] == hf_outputs


def test_chat_answers_like_transformers(smollm_llm):
    result = smollm_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                             dataclasses.replace(GREEDY, max_tokens=20, ignore_eos=False))[0]
    assert result.text == "The capital of France is Paris."
    assert result.finish_reason == "stop"
