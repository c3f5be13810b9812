"""Prompt logprobs from the prefill against transformers' log-softmax on the same fp32 weights: in chunks smaller than
the prompt, beside requests that decode, under preemption, and for a prompt whose prefix is cached (recomputed, not
read from the cache), with each entry's top candidates and rank."""

import pytest
import torch

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def reference(smollm_hf, prompt_ids):
    """transformers' log-softmax over each prompt, [L, vocab]."""
    model, _ = smollm_hf
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompt_ids]


def _check(entries, prompt, logprobs, k):
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        logprob, top, rank = entries[i]
        row = logprobs[i - 1]
        assert abs(logprob - row[prompt[i]].item()) < 1e-4
        assert rank == int((row > row[prompt[i]]).sum()) + 1
        values, ids = row.topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(top, values.tolist()))


def test_chunked_prefills_beside_decodes_and_preemption(smollm_llm, prompt_ids, reference):
    kv_bytes_per_token = smollm_llm.engine.info.kv_bytes_per_token
    llm = LLM(dtype="float32", kv_cache_dtype="fp32", block_size=16, max_model_len=320, max_num_batched_tokens=48,
              kv_cache_memory=(320 + 16) * kv_bytes_per_token)  # tight: the four requests preempt each other
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=3)
    results = llm.generate(prompt_ids[:4], params)
    assert llm.engine.scheduler.num_preemptions_total >= 1
    assert max(len(p) for p in prompt_ids[:4]) > 48  # at least one prompt came in several chunks
    for result, prompt, logprobs in zip(results, prompt_ids, reference):
        _check(result.outputs[0].prompt_logprobs, prompt, logprobs, 3)
    plain = llm.generate(prompt_ids[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert plain.outputs[0].prompt_logprobs is None and plain.token_ids == results[0].token_ids


def test_a_cached_prefix_is_recomputed(smollm_llm, prompt_ids, reference):
    prompt = prompt_ids[-1]  # the longest: several full blocks to hit
    smollm_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # its blocks are now cached
    cached = smollm_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert cached.outputs[0].num_cached_tokens > 0
    again = smollm_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert again.outputs[0].num_cached_tokens == 0 and again.token_ids == cached.token_ids
    _check(again.outputs[0].prompt_logprobs, prompt, reference[-1], 0)
