"""The layer stack in one C call (models/cpu_stack.py, kernels/cpu/decoder.c) against the same model run eagerly
(models/llama.py's layers, op by op, with the same C kernels): teacher-forced logits through decodes and the "paged"
prefill kernel's chunks, on a tiny Llama and a tiny Qwen2 (random q/k/v biases), int4 weights, bf16 cache (a float32
model's decodes over a bf16 or float32 cache too); which
models and steps it takes and which it leaves to the model; and its errors."""

import pytest
import torch

from tests.helpers import teacher_forced_logits
from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine.warmup import synthetic_step
from tokenmill.kernels import cpu_attention
from tokenmill.kernels.cpu_native import amx_available, library
from tokenmill.models.cpu_stack import CPUDecoderStack

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler")

ENGINE = dict(dtype="bfloat16", kv_cache_dtype="bf16", kv_cache_memory="16MiB", max_num_batched_tokens=8,
              num_threads=2, quantization="int4", quantization_group_size=32)


# The prefill kernels the stack runs chunks with: the paged kernel's causal segments, and prefill_attention.c's
# own-token kernels where this build has them (AVX512-BF16; AMX tiles, native or the stand-in build's).
STACK_KERNELS = ["paged"] + (["avx512"] if library() is not None and library().tm_attention_bf16_dot() else []) \
    + (["amx"] if amx_available() else [])


@pytest.fixture
def prefill_kernel(monkeypatch, request):
    """Engines built in the test settle the prefill kernel ``request.param`` (an engine sets it for the process),
    the kernel before restored after."""
    before = cpu_attention.prefill_kernel()
    monkeypatch.setenv("TOKENMILL_PREFILL_ATTENTION", request.param)
    yield request.param
    cpu_attention.set_prefill_kernel(before)


def counting(stack, with_prefills=None):
    """Wrap ``stack.run`` to list, per step, whether it took the step (returned hidden states for it); with a list
    ``with_prefills``, also whether each step had prefill chunks."""
    taken = []
    run = stack.run

    def counted(input_ids, positions, meta, kv_cache):
        hidden = run(input_ids, positions, meta, kv_cache)
        taken.append(hidden is not None)
        if with_prefills is not None:
            with_prefills.append(bool(meta.prefill_indices))
        return hidden
    stack.run = counted
    return taken


# (family, head size, prefill kernel): the own-token kernels take head sizes that are multiples of 32
CASES = [("llama", 16, "paged"), ("qwen2", 16, "paged")] + [("llama", 32, kernel) for kernel in STACK_KERNELS[1:]]


@pytest.fixture
def gemms_on_tiles(monkeypatch, request):
    """With ``request.param`` true, every quantized layer of the engines built in the test takes the C kernel's AMX
    build from one row (as if start-up had settled ``amx_from_rows`` 1), so the stack's GEMMs run on tiles."""
    if request.param:
        from tokenmill.engine import build
        settled = build.quantization_plan
        monkeypatch.setattr(build, "quantization_plan", lambda *args: {
            path: plan._replace(amx_from_rows=1) for path, plan in settled(*args).items()})
    return request.param


# (family, head size, prefill kernel, GEMMs on AMX tiles)
STACK_CASES = [(*case, False) for case in CASES] + ([("llama", 32, "amx", True)] if amx_available() else [])


@pytest.mark.parametrize(("arch", "head_dim", "prefill_kernel", "gemms_on_tiles"), STACK_CASES,
                         indirect=["prefill_kernel", "gemms_on_tiles"])
def test_stack_matches_the_model_run_eagerly(tmp_path, smollm_llm, arch, head_dim, prefill_kernel, gemms_on_tiles):
    make_llama_checkpoint(tmp_path, smollm_llm, arch=arch, head_dim=head_dim)
    stacked = LLM(model=str(tmp_path), **ENGINE)
    eager = LLM(model=str(tmp_path), enforce_eager=True, cpu_layer_stack=False, **ENGINE)
    stack = stacked.engine.runner.model.cpu_stack
    assert stack is not None and eager.engine.runner.model.cpu_stack is None
    if gemms_on_tiles:
        assert all(llm.engine.runner.model.layers[0].mlp.gate_up_proj._cpu_kernel._weight.amx_from_rows == 1
                   for llm in (stacked, eager))
    taken = counting(stack)
    ids = torch.randint(0, 1000, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    for chunk in (1, 3, None):  # every position a decode; chunks of 3 over a cached prefix; the prompt in one step
        taken.clear()
        got = teacher_forced_logits(stacked.engine.runner.model, stacked.engine.runner.kv_cache, ids, chunk)
        want = teacher_forced_logits(eager.engine.runner.model, eager.engine.runner.kv_cache, ids, chunk)
        # every step: under an own-token kernel, chunks over a cached prefix too (the kernel reads the prefix)
        assert taken and all(taken), "the stack left a step to the model"
        # the same kernels in the same order: only the norms' float sums may round differently (1 bf16 ulp, now and
        # then, carried on)
        torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0.02)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("prefill_kernel", ["sdpa"] + STACK_KERNELS[1:], indirect=True)
def test_generation_through_the_stack_and_the_steps_it_leaves(tmp_path, smollm_llm, prefill_kernel):
    """Mixed batches (prompts of 1-23 tokens, 8 a step) against the compiled graph alone: the same tokens, up to the
    norms' rounding. Under "sdpa" the steps with prefill chunks are the graph's; under an own-token kernel every step
    is the stack's, chunks over a cached prefix (and decodes beside them) included."""
    make_llama_checkpoint(tmp_path, smollm_llm, head_dim=32)
    stacked = LLM(model=str(tmp_path), enforce_eager=False, **ENGINE)
    plain = LLM(model=str(tmp_path), enforce_eager=False, cpu_layer_stack=False, **ENGINE)
    assert plain.engine.runner.model.cpu_stack is None
    prefills = []
    taken = counting(stacked.engine.runner.model.cpu_stack, prefills)
    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1, 5, 9, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    got, want = stacked.generate(prompts, params), plain.generate(prompts, params)
    if prefill_kernel == "sdpa":
        assert any(taken) and not any(t and p for t, p in zip(taken, prefills))
    else:
        assert all(taken)
    # 23 tokens at 8 a step: chunks over a cached prefix
    assert any(p for p in prefills) and sum(prefills) > len(prompts)
    for a, b in zip(got, want):
        assert len(a.token_ids) == len(b.token_ids) == 12
        # where the greedy tokens agree so far, the chosen token's logprob agrees too
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                break
            assert abs(a.logprobs[i][0] - b.logprobs[i][0]) < 0.05  # (the sampled token's logprob, top candidates)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp32"])
def test_a_float32_model_decodes_on_the_stack_and_leaves_it_its_prompts(tmp_path, smollm_llm, kv_cache_dtype):
    """A float32 model (the dtype start-up settles on hosts without AVX512-BF16 or AMX) over a bf16 cache (rounded as
    it is written) or a float32 one: every decode on the stack, against the model run eagerly (the same kernels,
    float32 norms and adds: only their sums' order differs); steps with prefill chunks stay the model's (the own-token
    prefill kernels are bf16)."""
    make_llama_checkpoint(tmp_path, smollm_llm, arch="qwen2")
    engine = {**ENGINE, "dtype": "float32", "kv_cache_dtype": kv_cache_dtype}
    stacked = LLM(model=str(tmp_path), **engine)
    eager = LLM(model=str(tmp_path), enforce_eager=True, cpu_layer_stack=False, **engine)
    stack = stacked.engine.runner.model.cpu_stack
    assert stack is not None and stacked.engine.runner.kv_cache.data[0].dtype is \
        {"bf16": torch.bfloat16, "fp32": torch.float32}[kv_cache_dtype]
    prefills = []
    taken = counting(stack, prefills)
    ids = torch.randint(0, 1000, (23,), generator=torch.Generator().manual_seed(2)).tolist()
    for chunk in (1, 5):  # every position a decode; chunks of 5 over a cached prefix (the model's)
        taken.clear()
        prefills.clear()
        got = teacher_forced_logits(stacked.engine.runner.model, stacked.engine.runner.kv_cache, ids, chunk)
        want = teacher_forced_logits(eager.engine.runner.model, eager.engine.runner.kv_cache, ids, chunk)
        assert taken == [not p for p in prefills] and (chunk == 1) == all(taken)
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
    # served generations: decodes on the stack beside the model's prefill steps, the tokens the graph alone makes
    plain = LLM(model=str(tmp_path), enforce_eager=False, cpu_layer_stack=False, **engine)
    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (2, 11, 19)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    taken.clear()
    got, want = stacked.generate(prompts, params), plain.generate(prompts, params)
    assert any(taken)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x[0] - y[0]) < 1e-3


def test_models_and_caches_it_leaves_to_the_model(tmp_path, smollm_llm):
    make_llama_checkpoint(tmp_path, smollm_llm)
    fp16 = LLM(model=str(tmp_path), **{**ENGINE, "dtype": "float16", "kv_cache_dtype": "fp16"})
    assert fp16.engine.runner.model.cpu_stack is None  # float16 norms and activations
    fp8 = LLM(model=str(tmp_path), **{**ENGINE, "kv_cache_dtype": "fp8"})
    stack = fp8.engine.runner.model.cpu_stack
    assert stack is not None
    taken = counting(stack)
    out = fp8.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and taken and not any(taken)  # an fp8 cache: every step the model's
    f32_fp8 = LLM(model=str(tmp_path), **{**ENGINE, "dtype": "float32", "kv_cache_dtype": "fp8"})
    taken = counting(f32_fp8.engine.runner.model.cpu_stack)
    f32_fp8.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert taken and not any(taken)
    model = fp8.engine.runner.model
    model.layers[1].post_attention_layernorm.eps = 1e-6  # decoder.c takes one eps for every norm
    assert CPUDecoderStack.build(model) is None


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
