"""The layer stack in one C call (kernels/cpu_decoder.py, kernels/cpu/decoder.c) against the same model run eagerly
(models/llama.py's layers, op by op, with the same C kernels): teacher-forced logits through decodes and the "paged"
prefill kernel's chunks, on a tiny Llama and a tiny Qwen2 (random q/k/v biases), int4 weights, bf16 cache; which
models and steps it takes and which it leaves to the model; and its errors."""

import pytest
import torch

from tests.helpers import teacher_forced_logits
from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine.warmup import synthetic_step
from tokenmill.kernels import cpu_attention
from tokenmill.kernels.cpu_native import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler")

ENGINE = dict(dtype="bfloat16", kv_cache_dtype="bf16", kv_cache_memory="16MiB", max_num_batched_tokens=8,
              num_threads=2, quantization="int4", quantization_group_size=32)


@pytest.fixture
def paged_prefill(monkeypatch):
    """Engines built in the test settle the "paged" prefill kernel (the stack takes prefill chunks only under it; an
    engine sets it for the process), the kernel before restored after."""
    before = cpu_attention.prefill_kernel()
    monkeypatch.setenv("TOKENMILL_PREFILL_ATTENTION", "paged")
    yield
    cpu_attention.set_prefill_kernel(before)


def counting(stack):
    """Wrap ``stack.run`` to count the steps it took (returned hidden states for)."""
    taken = []
    run = stack.run

    def counted(*args):
        hidden = run(*args)
        taken.append(hidden is not None)
        return hidden
    stack.run = counted
    return taken


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stack_matches_the_model_run_eagerly(tmp_path, smollm_llm, paged_prefill, arch):
    make_llama_checkpoint(tmp_path, smollm_llm, arch=arch)
    stacked = LLM(model=str(tmp_path), **ENGINE)
    eager = LLM(model=str(tmp_path), enforce_eager=True, cpu_layer_stack=False, **ENGINE)
    stack = stacked.engine.runner.model.cpu_stack
    assert stack is not None and eager.engine.runner.model.cpu_stack is None
    taken = counting(stack)
    ids = torch.randint(0, 1000, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    for chunk in (1, 3, None):  # every position a decode; chunks of 3 over a cached prefix; the prompt in one step
        taken.clear()
        got = teacher_forced_logits(stacked.engine.runner.model, stacked.engine.runner.kv_cache, ids, chunk)
        want = teacher_forced_logits(eager.engine.runner.model, eager.engine.runner.kv_cache, ids, chunk)
        assert taken and all(taken), "the stack left a step to the model"
        # the same kernels in the same order: only the norms' float sums may round differently (1 bf16 ulp, now and
        # then, carried on)
        torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0.02)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_generation_through_the_stack_and_the_steps_it_leaves(tmp_path, smollm_llm):
    """Mixed batches under the settled prefill kernel: decodes through the stack, prefill chunks (unless the "paged"
    kernel was settled) through the compiled graph, against the compiled graph alone: the same tokens, up to the
    norms' rounding."""
    make_llama_checkpoint(tmp_path, smollm_llm)
    stacked = LLM(model=str(tmp_path), enforce_eager=False, **ENGINE)
    plain = LLM(model=str(tmp_path), enforce_eager=False, cpu_layer_stack=False, **ENGINE)
    assert plain.engine.runner.model.cpu_stack is None
    taken = counting(stacked.engine.runner.model.cpu_stack)
    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1, 5, 9, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    got, want = stacked.generate(prompts, params), plain.generate(prompts, params)
    assert any(taken) and (cpu_attention.prefill_kernel() == "paged" or not all(taken))
    for a, b in zip(got, want):
        assert len(a.token_ids) == len(b.token_ids) == 12
        # where the greedy tokens agree so far, the chosen token's logprob agrees too
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            assert abs(a.logprobs[i][0] - b.logprobs[i][0]) < 0.05  # (the sampled token's logprob, top candidates)


def test_models_and_caches_it_leaves_to_the_model(tmp_path, smollm_llm):
    make_llama_checkpoint(tmp_path, smollm_llm)
    fp32 = LLM(model=str(tmp_path), **{**ENGINE, "dtype": "float32", "kv_cache_dtype": "fp32"})
    assert fp32.engine.runner.model.cpu_stack is None  # float32 norms and activations
    fp8 = LLM(model=str(tmp_path), **{**ENGINE, "kv_cache_dtype": "fp8"})
    stack = fp8.engine.runner.model.cpu_stack
    assert stack is not None
    taken = counting(stack)
    out = fp8.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and taken and not any(taken)  # an fp8 cache: every step the model's


def test_a_position_past_the_rotary_table_is_an_error_not_a_write(tmp_path, smollm_llm):
    make_llama_checkpoint(tmp_path, smollm_llm)
    llm = LLM(model=str(tmp_path), **ENGINE)
    model, kv_cache = llm.engine.runner.model, llm.engine.runner.kv_cache
    input_ids, positions, meta = synthetic_step(kv_cache, 2, 1, 16)
    positions[1] = model.layers[0].self_attn.rotary.cos.shape[0]
    before = [data.clone() for data in kv_cache.data]
    with pytest.raises(IndexError, match="rotary"):
        model.cpu_stack.run(input_ids, positions, meta, kv_cache)
    assert all(torch.equal(a, b) for a, b in zip(before, kv_cache.data))
