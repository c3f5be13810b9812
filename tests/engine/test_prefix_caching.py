"""Prefix caching end to end on tiny random checkpoints (GQA Llama, MLA DeepSeek-V2): what is identical with caching
on and off, and why.

- fp32 KV cache: greedy tokens are identical, logprobs equal to float rounding (a hit reads the prefix's K/V back
  from the cache, exact in fp32; only the attention's summation order differs from one long prefill).
- bf16 / fp8 KV cache: a prefill computes its own tokens' attention over their K/V as computed, unquantized, and its
  cached prefix's as stored, quantized (kernels/paged_attention.py). So a hit is not bit-identical to computing the
  whole prompt in one chunk; it is bit-identical to a prefill chunked at the hit, which the second test asserts.
"""

import random

import pytest

from tests.tiny_checkpoints import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
rng = random.Random(5)
SHARED = [rng.randrange(1000, 20000) for _ in range(48)]  # 3 blocks of 16
QUESTIONS = [[rng.randrange(1000, 20000) for _ in range(n)] for n in (9, 16, 23)]


@pytest.fixture(scope="module", params=["dense-gqa", "v2-lite-like"])
def checkpoint(request, tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(path, smollm_llm, request.param)
    return str(path)


def first_then_rest(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """The first prompt alone (it fills the cache), then the others together."""
    return llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)


def test_fp32_outputs_equal_with_caching_on_and_off(checkpoint):
    prompts = [SHARED + q for q in QUESTIONS]
    results = {}
    for caching in (True, False):
        llm = LLM(model=checkpoint, dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB",
                  enable_prefix_caching=caching)
        results[caching] = first_then_rest(llm, prompts, GREEDY)
        stats = llm.engine.stats()
        assert stats.prefix_cache_hits_total == (96 if caching else 0)  # 48 tokens for each of the 2 later prompts
    on, off = results[True], results[False]
    assert [r.outputs[0].num_cached_tokens for r in on] == [0, 48, 48]
    assert [r.outputs[0].num_cached_tokens for r in off] == [0, 0, 0]
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert [lp for lp, _ in a.logprobs] == pytest.approx([lp for lp, _ in b.logprobs], abs=1e-4)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_quantized_cache_hit_equals_a_prefill_chunked_at_the_hit(checkpoint, kv_dtype):
    # A budget of 48 tokens splits every prompt at token 48, where the shared prefix ends.
    common = dict(model=checkpoint, dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_memory="8MiB",
                  max_num_batched_tokens=48)
    prompts = [SHARED + q for q in QUESTIONS]
    on, off = LLM(**common), LLM(**common, enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):  # one at a time: batches of one, so decode GEMMs match too
        hit, chunked = on.generate([prompt], GREEDY)[0], off.generate([prompt], GREEDY)[0]
        assert hit.outputs[0].num_cached_tokens == (48 if i else 0)
        assert hit.token_ids == chunked.token_ids
        assert hit.logprobs == chunked.logprobs  # bit-identical


def test_cache_salt_isolates_and_usage_reports_cached_tokens(checkpoint):
    from tokenmill.engine.messages import EngineRequest
    import time

    llm = LLM(model=checkpoint, dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB")
    prompt = SHARED + QUESTIONS[0]
    seen = {}
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"), ("d", None)):
        llm.engine.add_request(EngineRequest(rid, prompt, GREEDY, GREEDY.max_tokens, time.monotonic(), salt))
        while llm.engine.has_unfinished():
            for out in llm.engine.step().outputs:
                seen[out.request_id] = out.num_cached_tokens
    assert seen == {"a": 0, "b": 0, "c": 48, "d": 0}
