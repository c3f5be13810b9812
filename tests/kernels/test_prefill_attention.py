"""A prefill chunk's attention over its own tokens by kernels/cpu/prefill_attention.c, on AMX tiles ("amx") or in
AVX512-BF16 registers ("avx512"), selected by engine/prefill_attention.py: exact causal attention to bf16 precision,
GQA groups, tails of every length, strided queries, the log-sum-exp the merge with a cached prefix needs, and whole
paged batches against the PyTorch reference. Where a build does not run here (no AMX; no AVX512-BF16 in the build)
it declines (None) and SDPA answers instead, which is checked too."""

import pytest
import torch

from tests.engine.test_settle import scripted
from tests.kernels.paging import paged_batch
from tests.kernels.test_cpu_attention import attention_both_ways
from tokenmill.config import ConfigError
from tokenmill.engine import prefill_attention
from tokenmill.kernels import cpu_attention, cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")
AMX = cpu_native.amx_available()
# Where each C kernel runs: AMX as the host grants it; AVX512-BF16 as this build of the library has it (the decode
# kernel's bf16 path needs the same instructions and is itself held to the CPU's flags in test_cpu_attention.py).
RUNS = {"amx": AMX, "avx512": cpu_native.library() is not None and bool(cpu_native.library().tm_attention_bf16_dot())}
C_KERNELS = sorted(RUNS)


@pytest.fixture
def restore_kernel():
    before = cpu_attention.prefill_kernel()
    yield
    cpu_attention.set_prefill_kernel(before)


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention in float64 over the bf16 inputs: (out [L, Hq, D], lse [L, Hq])."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    length = q.shape[0]
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v), scores.logsumexp(-1).t()


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 31, 32, 33, 100, 300])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 64), (2, 1, 256)])
def test_the_c_kernel_is_causal_attention(kernel, length, hq, hkv, d):
    gen = torch.Generator().manual_seed(length + d)
    fused = (torch.randn(length, hq + 2 * hkv, d, generator=gen) * 1.5).bfloat16()  # q, k, v views of one projection
    q, k, v = fused.split([hq, hkv, hkv], dim=1)
    result = cpu_attention.c_prefill_attention(kernel, q, k, v, d ** -0.5)
    if not RUNS[kernel]:
        assert result is None  # declined: own_tokens_attention runs SDPA
        return
    out, lse = result
    want_out, want_lse = exact(q, k, v, d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and not out.isnan().any()
    # bf16 probabilities (relative error <= 2^-8 each: bf16 keeps 8 significant bits) summed as rounded, then the
    # output's rounding to bf16 (<= 2^-8 relative); the sum of the rounded probabilities is within 2^-8 of the exact one
    bound = 2 * 2 ** -8 * v.float().abs().max().item()
    torch.testing.assert_close(out.double(), want_out, atol=bound, rtol=2 ** -8)
    torch.testing.assert_close(lse.double(), want_lse, atol=2 ** -8 + 1e-5, rtol=0)


@pytest.mark.parametrize("kernel", C_KERNELS)
def test_a_step_of_chunks_in_one_call(kernel):
    """Several chunks of one step's rows in one call, into a given output: each chunk is causal over its own rows
    only, and rows of no chunk (a decode's, between them) keep what the output held."""
    hq, hkv, d = 9, 3, 64
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(100, hq + 2 * hkv, d, generator=gen).bfloat16()
    q, k, v = fused.split([hq, hkv, hkv], dim=1)
    chunks = [(0, 5), (5, 40), (60, 17), (99, 1)]
    out = torch.full((100, hq, d), 7.0, dtype=torch.bfloat16)
    result = cpu_attention.c_prefill_attention(kernel, q, k, v, d ** -0.5, chunks, out)
    if not RUNS[kernel]:
        assert result is None and (out == 7.0).all()
        return
    assert result[0] is out
    bound = 2 * 2 ** -8 * v.float().abs().max().item()
    for start, length in chunks:
        rows = slice(start, start + length)
        want_out, want_lse = exact(q[rows], k[rows], v[rows], d ** -0.5)
        torch.testing.assert_close(out[rows].double(), want_out, atol=bound, rtol=2 ** -8)
        torch.testing.assert_close(result[1][rows].double(), want_lse, atol=2 ** -8 + 1e-5, rtol=0)
    assert (out[45:60] == 7.0).all() and (out[77:99] == 7.0).all()


def exact_over_prefix(q, k_prefix, v_prefix, k, v, scale):
    """Causal attention in float64 of queries after a prefix: query i sees the whole prefix and its own keys 0 .. i."""
    group = q.shape[1] // k.shape[1]
    keys = torch.cat([k_prefix, k]).double().repeat_interleave(group, 1)
    values = torch.cat([v_prefix, v]).double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    own, before = q.shape[0], k_prefix.shape[0]
    seen = torch.ones(own, before + own, dtype=torch.bool).tril(before)
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values), scores.logsumexp(-1).t()


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("hq,hkv,d,block_size", [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 32, 16)])
def test_chunks_over_cached_prefixes_read_through_the_block_table(kernel, hq, hkv, d, block_size):
    """Chunks after prefixes of 0-140 cached tokens (none a multiple of the cache's block; prefix and chunk together
    a whole number of the kernel's 32-key blocks once, a padded one otherwise), the prefixes on scattered blocks of a
    paged cache: each chunk's queries see their prefix and their own keys causally, one softmax, against float64."""
    gen = torch.Generator().manual_seed(d + block_size)
    chunks = [(0, 20), (20, 33), (53, 1), (54, 16)]  # (first row, length) of the step's rows
    prefix_lens = [44, 0, 140, 5]  # 44 + 20: whole blocks of the kernel's 32 keys, no padding
    rows = sum(length for _, length in chunks)
    fused = torch.randn(rows, hq + 2 * hkv, d, generator=gen).bfloat16()
    q, k, v = fused.split([hq, hkv, hkv], dim=1)
    # the cache [blocks][block_size][2 hkv][d]: each chunk's prefix on blocks in a shuffled order
    blocks_each = [-(-n // block_size) for n in prefix_lens]
    order = torch.randperm(sum(blocks_each) + 1, generator=gen).tolist()
    cache = torch.randn(len(order), block_size, 2 * hkv, d, generator=gen).bfloat16()
    tables = torch.zeros(len(chunks) + 1, max(blocks_each), dtype=torch.int64)
    for c, count in enumerate(blocks_each):
        tables[c + 1, :count] = torch.tensor(order[sum(blocks_each[:c]):sum(blocks_each[:c + 1])])
    table_rows = list(range(1, len(chunks) + 1))  # row 0 is no chunk's
    meta = torch.tensor([table_rows, prefix_lens], dtype=torch.int64)
    prefix = cpu_attention.PrefillPrefix(cache.data_ptr(), tables.data_ptr(), tables.stride(0), block_size,
                                         meta[0].data_ptr(), meta[1].data_ptr())
    result = cpu_attention.c_prefill_attention(kernel, q, k, v, d ** -0.5, chunks, prefix=prefix)
    if not RUNS[kernel]:
        assert result is None
        return
    out, lse = result
    bound = 2 * 2 ** -8 * max(v.float().abs().max().item(), cache.float().abs().max().item())
    for c, (start, length) in enumerate(chunks):
        tokens = cache[tables[c + 1]].flatten(0, 1)[:prefix_lens[c]]  # [P, 2 hkv, d]
        own = slice(start, start + length)
        want_out, want_lse = exact_over_prefix(q[own], tokens[:, :hkv], tokens[:, hkv:], k[own], v[own], d ** -0.5)
        torch.testing.assert_close(out[own].double(), want_out, atol=bound, rtol=2 ** -8)
        torch.testing.assert_close(lse[own].double(), want_lse, atol=2 ** -8 + 1e-5, rtol=0)


@pytest.mark.parametrize("kernel", C_KERNELS)
def test_layouts_the_kernel_does_not_take_are_declined(kernel):
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    assert cpu_attention.c_prefill_attention(kernel, q.float(), q.float(), q.float(), 0.1) is None  # float32
    assert cpu_attention.c_prefill_attention(kernel, q[..., :48].contiguous(), q[..., :48].contiguous(),
                                             q[..., :48].contiguous(), 0.1) is None  # D not a multiple of 32
    wide = torch.zeros(4, 1, 288, dtype=torch.bfloat16)
    assert cpu_attention.c_prefill_attention(kernel, wide, wide, wide, 0.1) is None  # D above 256
    transposed = q.transpose(0, 1).contiguous().transpose(0, 1)  # heads not contiguous within a token
    assert cpu_attention.c_prefill_attention(kernel, transposed, q, q, 0.1) is None
    odd = torch.zeros(4, 4 * 64 + 1, dtype=torch.bfloat16)[:, :4 * 64].unflatten(1, (4, 64))  # rows 257 apart
    assert cpu_attention.c_prefill_attention(kernel, odd, q, q, 0.1) is None


@pytest.mark.parametrize("kernel", ["sdpa", "amx", "avx512", "paged"])
@pytest.mark.parametrize("seed", range(4))
def test_whole_batches_with_cached_prefixes_match_the_reference(restore_kernel, kernel, seed):
    """Decodes and prefill chunks with and without a cached prefix (the own-token part merged with the prefix's by
    log-sum-exp) over a bf16 cache, with either own-token kernel."""
    cpu_attention.set_prefill_kernel(kernel)
    shapes = [(0, 40), (37, 50), (0, 1), (100, 1), (16, 16), (5, 97)][seed:] + [(3, 33)]
    batch = paged_batch(shapes, 9, 3, 64, "bf16", 16, num_blocks=256, q_dtype=torch.bfloat16, seed=seed)
    got, want = attention_both_ways(batch, 3, 64)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="flash"):
        cpu_attention.set_prefill_kernel("flash")


ARGS = (9, 3, 64, torch.bfloat16, 2)


@pytest.mark.parametrize("kernel", C_KERNELS)
@pytest.mark.parametrize("kernel_over_sdpa,faster", [([0.5, 0.6], True), ([0.97, 0.98], False), ([1.3, 1.2], False)])
def test_a_c_kernel_only_where_clearly_faster(monkeypatch, kernel, kernel_over_sdpa, faster):
    monkeypatch.setattr(prefill_attention, "c_kernel_applies", lambda name, *a: name == kernel)
    monkeypatch.setattr(prefill_attention, "time_kernels", scripted(kernel_over_sdpa))
    assert prefill_attention.choose_prefill_attention("auto", "cpu", "cpu", *ARGS) == (kernel if faster else "sdpa")
    assert prefill_attention.choose_prefill_attention("sdpa", "cpu", "cpu", *ARGS) == "sdpa"  # as configured
    assert prefill_attention.choose_prefill_attention(kernel, "cpu", "cpu", *ARGS) == kernel


def test_each_candidate_meets_the_best_so_far(monkeypatch):
    """AMX, then AVX512-BF16, then paged, each timed against the fastest before it."""
    monkeypatch.setattr(prefill_attention, "c_kernel_applies", lambda name, *a: True)
    timed = []
    ratios = iter([[0.5, 0.5], [0.97, 0.97], [0.5, 0.5]])  # amx / sdpa, avx512 / amx (not 5% faster), paged / amx
    monkeypatch.setattr(prefill_attention, "time_kernels",
                        lambda a, b, *rest, **kw: timed.append((a, b)) or scripted(next(ratios))())
    assert prefill_attention.choose_prefill_attention("auto", "cpu", "cpu", *ARGS, kv_dtype="bf16") == "paged"
    assert timed == [("sdpa", "amx"), ("amx", "avx512"), ("amx", "paged")]


def test_too_noisy_or_not_applicable_keeps_sdpa(monkeypatch):
    monkeypatch.setattr(prefill_attention, "c_kernel_applies", lambda *a: True)
    monkeypatch.setattr(prefill_attention, "time_kernels", scripted([0.5], noisy=True))
    assert prefill_attention.choose_prefill_attention("auto", "cpu", "cpu", *ARGS) == "sdpa"

    def not_timed(*args, **kwargs):
        raise AssertionError("nothing to time where the AMX kernel does not run")
    monkeypatch.setattr(prefill_attention, "time_kernels", not_timed)
    for device, backend, hkv in [("cuda", "triton", 3), ("cpu", "torch", 3), ("cpu", "cpu", 0)]:
        assert prefill_attention.choose_prefill_attention("auto", device, backend, 9, hkv, 64, torch.bfloat16,
                                                          2) == "sdpa"
    monkeypatch.setattr(prefill_attention, "c_kernel_applies", lambda *a: False)  # no AMX / AVX512-BF16, float32
    assert prefill_attention.choose_prefill_attention("auto", "cpu", "cpu", *ARGS) == "sdpa"
    with pytest.raises(ConfigError, match="AMX"):
        prefill_attention.choose_prefill_attention("amx", "cpu", "cpu", *ARGS)
    with pytest.raises(ConfigError, match="AVX512-BF16"):
        prefill_attention.choose_prefill_attention("avx512", "cpu", "cpu", *ARGS)


@pytest.mark.parametrize("kernel", C_KERNELS)
def test_applies_exactly_where_the_kernel_runs(kernel):
    assert prefill_attention.c_kernel_applies(kernel, 9, 3, 64, torch.bfloat16) == RUNS[kernel]
    assert not prefill_attention.c_kernel_applies(kernel, 9, 3, 64, torch.float32)
    assert not prefill_attention.c_kernel_applies(kernel, 9, 3, 40, torch.bfloat16)


@pytest.mark.parametrize("candidate", ["amx", "avx512", "paged"])
def test_the_probe_times_both_kernels_and_restores_the_choice(restore_kernel, candidate):
    cpu_attention.set_prefill_kernel("sdpa")  # (where a C kernel does not run, its cases run SDPA: a ratio near 1)
    threads = torch.get_num_threads()
    comparison = prefill_attention.time_kernels("sdpa", candidate, 9, 3, 64, 1, budget_s=5.0)
    assert comparison.rounds and all(r > 0 for r in comparison.rounds)
    assert cpu_attention.prefill_kernel() == "sdpa" and torch.get_num_threads() == threads


def test_the_paged_probe_runs_what_serving_runs(monkeypatch):
    """The "paged" probe's work is the prompt's causal attention: its output is exact causal attention to bf16
    precision."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(70, 9 + 6, 64, generator=gen).bfloat16()
    q, k, v = qkv.split([9, 3, 3], dim=1)
    captured = []
    real = cpu_attention.step_attention_bf16
    monkeypatch.setattr(prefill_attention, "step_attention_bf16", lambda *a, **kw: captured.append(real(*a, **kw)))
    prefill_attention._chunk_work("paged", qkv, 9, 3, 64, 16)()
    want, _ = exact(q, k, v, 64 ** -0.5)
    torch.testing.assert_close(captured[0].double(), want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("kernel", ["sdpa", "paged"] + [k for k in C_KERNELS if RUNS[k]])
def test_the_prefixed_probe_runs_what_serving_runs(monkeypatch, restore_kernel, kernel):
    """The probe's chunk after a cached prefix goes through the attention op as serving runs it, each kernel's way:
    its output is the chunk's causal attention over prefix and itself, to bf16 precision."""
    gen = torch.Generator().manual_seed(4)
    cached, length = 40, 30
    qkv = torch.randn(cached + length, 9 + 6, 64, generator=gen).bfloat16()
    q, k, v = qkv.split([9, 3, 3], dim=1)
    captured = []
    real = cpu_attention.paged_attention_cpu
    monkeypatch.setattr(prefill_attention, "paged_attention_cpu",
                        lambda *a, **kw: captured.append((cpu_attention.prefill_kernel(), real(*a, **kw))))
    prefill_attention._prefixed_work(kernel, qkv, cached, 9, 3, 64, 16)()
    want, _ = exact_over_prefix(q[cached:], k[:cached], v[:cached], k[cached:], v[cached:], 64 ** -0.5)
    (ran, got), = captured
    assert ran == kernel and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("paged_over_best,expected", [([0.5, 0.6], "paged"), ([0.97, 0.98], "sdpa")])
def test_the_paged_kernel_only_where_clearly_faster(monkeypatch, paged_over_best, expected):
    monkeypatch.setattr(prefill_attention, "c_kernel_applies", lambda *a: False)
    timed = []
    monkeypatch.setattr(prefill_attention, "time_kernels",
                        lambda a, b, *rest, **kw: timed.append((a, b)) or scripted(paged_over_best)())
    assert prefill_attention.choose_prefill_attention("auto", "cpu", "cpu", *ARGS, kv_dtype="bf16") == expected
    assert timed == [("sdpa", "paged")]
    # not a candidate over an fp8 cache or for a float32 model; refused when asked for there
    timed.clear()
    assert prefill_attention.choose_prefill_attention("auto", "cpu", "cpu", *ARGS, kv_dtype="fp8") == "sdpa"
    assert prefill_attention.choose_prefill_attention("auto", "cpu", "cpu", 9, 3, 64, torch.float32, 2,
                                                      kv_dtype="fp32") == "sdpa"
    assert timed == []
    with pytest.raises(ConfigError, match="bf16 KV cache"):
        prefill_attention.choose_prefill_attention("paged", "cpu", "cpu", *ARGS, kv_dtype="fp8")


def test_a_bf16_engine_prefills_as_exactly_with_either_kernel(smollm_hf, prompt_ids):
    """End to end: a bf16 engine prefilling in chunks of 48 tokens (so chunks after the first merge with their cached
    prefix) gives prompt logprobs as close to transformers' fp32 ones with each C kernel as with SDPA. Where one does
    not run, asking for it is refused at start-up."""
    from tokenmill import LLM, SamplingParams

    def run(kernel: str) -> list[list]:
        llm = LLM(dtype="bfloat16", kv_cache_dtype="bf16", kv_cache_memory="256MiB", max_model_len=1024,
                  max_num_batched_tokens=48, prefill_attention=kernel, enable_prefix_caching=False)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        return [r.outputs[0].prompt_logprobs for r in llm.generate(prompt_ids, params)]

    model, _ = smollm_hf
    with torch.no_grad():
        reference = [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompt_ids]

    def error(entries_per_prompt: list[list]) -> float:
        errors = [abs(entries[i][0] - ref[i - 1, prompt[i]].item())
                  for entries, ref, prompt in zip(entries_per_prompt, reference, prompt_ids)
                  for i in range(1, len(prompt))]
        return sum(errors) / len(errors)
    sdpa, paged = error(run("sdpa")), error(run("paged"))
    assert max(len(p) for p in prompt_ids) > 96  # some prompt came in three chunks or more
    assert paged <= 1.25 * sdpa + 0.01, (paged, sdpa)
    for kernel, needs in (("amx", "AMX"), ("avx512", "AVX512-BF16")):
        if not RUNS[kernel]:
            with pytest.raises(ConfigError, match=needs):
                run(kernel)
            continue
        own = error(run(kernel))
        assert own <= 1.25 * sdpa + 0.01, (kernel, own, sdpa)
