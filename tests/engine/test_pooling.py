"""Pooled final hidden states from the prefill (embeddings) against transformers' on the same fp32 weights: mean,
CLS and last-token pooling over prompts that come in several chunks, beside decoding requests, under preemption (a
recomputed prefill pools again from the start), and last-token pooling over a cached prefix."""

import torch

from tokenmill import LLM, SamplingParams


def _states(model, prompt):
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).last_hidden_state[0]


def test_pooling_over_chunks_beside_decodes(smollm_llm, smollm_hf, prompt_ids):
    model, _ = smollm_hf
    llm = LLM(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="64MiB", max_num_batched_tokens=32)
    prompts = [prompt_ids[4], prompt_ids[3], prompt_ids[2], prompt_ids[0]]
    assert max(len(p) for p in prompts) > 32  # prefilled in several chunks
    decoding = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    modes = ["mean", "cls", "last", "mean"]
    params = [decoding] * 2 + [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, pooling=m) for m in modes]
    results = llm.generate(prompt_ids[:2] + prompts, params)
    for result, prompt, mode in zip(results[2:], prompts, modes):
        states = _states(model, prompt)
        want = {"mean": states.mean(0), "cls": states[0], "last": states[-1]}[mode]
        got = torch.tensor(result.outputs[0].embedding)
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4, mode
    assert [r.outputs[0].embedding for r in results[:2]] == [None, None]


def test_a_preempted_prefill_pools_again_from_the_start(smollm_llm, smollm_hf, prompt_ids):
    """Two decoding requests fill the pool; a long mean-pooling prompt admitted then is preempted in its prefill
    (the newest request is the victim) and pools again once it is readmitted."""
    model, _ = smollm_hf
    kv_bytes_per_token = smollm_llm.engine.info.kv_bytes_per_token
    llm = LLM(dtype="float32", kv_cache_dtype="fp32", block_size=16, max_model_len=320, max_num_batched_tokens=32,
              kv_cache_memory=(320 + 16) * kv_bytes_per_token)
    engine = llm.engine
    decoding = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    for prompt in prompt_ids[:2]:
        llm.add_request(prompt, decoding)
    while engine.scheduler.kv.pool.num_free_blocks > 3:  # decode until the two hold all but three blocks
        engine.step()
    long = prompt_ids[4]
    pooled = llm.add_request(long, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, pooling="mean"))
    before = engine.scheduler.num_preemptions_total
    embedding = None
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.request_id == pooled and out.embedding is not None:
                embedding = out.embedding
    assert engine.scheduler.num_preemptions_total > before and len(long) > 3 * 16
    assert (torch.tensor(embedding) - _states(model, long).mean(0)).abs().max() < 1e-4


def test_last_token_pooling_reads_a_cached_prefix(smollm_llm, smollm_hf, prompt_ids):
    model, _ = smollm_hf
    prompt = prompt_ids[-1]
    last = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, pooling="last")
    smollm_llm.generate([prompt], last)
    again = smollm_llm.generate([prompt], last)[0].outputs[0]
    assert again.num_cached_tokens > 0  # only the last position is read: the cache may serve the rest
    mean = smollm_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, pooling="mean"))[0].outputs[0]
    assert mean.num_cached_tokens == 0  # a mean needs every position
    states = _states(model, prompt)
    assert (torch.tensor(again.embedding) - states[-1]).abs().max() < 1e-4
    assert (torch.tensor(mean.embedding) - states.mean(0)).abs().max() < 1e-4
