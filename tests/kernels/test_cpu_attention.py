"""The C paged-attention kernel (kernels/cpu/paged_attention.c, backend "cpu") against the PyTorch reference, on the
paging traps of tests/kernels/paging.py (permuted block tables, NaN in every unused slot, lengths 1 / block-aligned /
unaligned, cached prefixes), every cache dtype, GQA groups from 1 to 6 and odd head sizes."""

import pytest
import torch

from tests.kernels.paging import paged_batch, picker
from tokenmill.kernels import cpu_attention, cpu_native
from tokenmill.kernels.kv_write import dequantize, write_kv
from tokenmill.kernels.paged_attention import paged_attention

# (tokens cached before this step, new tokens) per request.
SHAPES = [(0, 1), (15, 1), (0, 16), (5, 6), (40, 1), (3, 33), (31, 1), (0, 2), (200, 1)]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")


def attention_both_ways(batch, hkv, d):
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping)
    args = (batch.q, batch.new_kv[:, :hkv], batch.new_kv[:, hkv:], batch.data, batch.scales, batch.meta, d ** -0.5)
    want = paged_attention(*args, backend="torch")
    batch.meta._derived.clear()  # nothing the reference derived may leak into the other path
    return paged_attention(*args, backend="cpu"), want


@pytest.mark.parametrize("kv_dtype,q_dtype", [("fp8", torch.float32), ("fp8", torch.bfloat16),
                                              ("fp16", torch.float16), ("bf16", torch.bfloat16),
                                              ("bf16", torch.float32), ("fp32", torch.float32)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_cpu_paged_attention_matches_reference(kv_dtype, q_dtype, block_size):
    hq, hkv, d = 6, 2, 40  # GQA group 3, head_dim not a multiple of the vector width
    batch = paged_batch(SHAPES, hq, hkv, d, kv_dtype, block_size, num_blocks=512, q_dtype=q_dtype)
    got, want = attention_both_ways(batch, hkv, d)
    assert got.dtype == want.dtype and not got.isnan().any()
    tol = TOLERANCE[q_dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_the_cpu_backend_reads_the_cache_in_place(monkeypatch):
    """The dispatch really runs the C kernel, and no gather of the cache happens on the way."""
    import tokenmill.kernels.paged_attention as reference

    calls = []
    real = cpu_attention.cache_attention
    monkeypatch.setattr(cpu_attention, "cache_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(reference, "_gather", lambda *a, **k: pytest.fail("the cpu backend gathered the cache"))
    batch = paged_batch(SHAPES, 4, 2, 16, "bf16", 4, num_blocks=512, q_dtype=torch.float32)
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping)
    args = (batch.q, batch.new_kv[:, :2], batch.new_kv[:, 2:], batch.data, batch.scales, batch.meta, 0.25)
    paged_attention(*args, backend="cpu")
    assert calls == [1]  # one kernel call serves every layer's whole batch: decodes and cached prefixes


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_reference(seed):
    """Random mixes of decodes and prefill chunks, head layouts, head sizes and block sizes."""
    gen = torch.Generator().manual_seed(seed)
    pick = picker(gen)
    hq, hkv = pick([(4, 4), (8, 2), (6, 1), (12, 4), (9, 3)])
    d, block_size, kv_dtype = pick([16, 40, 64, 128]), pick([1, 4, 8, 16, 32]), pick(["fp8", "fp32", "bf16"])
    shapes = [(int(torch.randint(0, 90, (1,), generator=gen)), pick([1, 1, 1, 2, 7, 19, 70]))
              for _ in range(int(torch.randint(1, 9, (1,), generator=gen)))]
    q_dtype = torch.bfloat16 if kv_dtype == "bf16" else torch.float32
    batch = paged_batch(shapes, hq, hkv, d, kv_dtype, block_size, num_blocks=1024, q_dtype=q_dtype, seed=seed)
    got, want = attention_both_ways(batch, hkv, d)
    tol = TOLERANCE[q_dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("shapes,window", [([(700, 1)], 0), ([(300, 1), (517, 1)], 0), ([(450, 20)], 0),
                                           ([(900, 1)], 333), ([(129, 1)], 0)])
def test_few_long_sequences_split_along_the_cache(threads, shapes, window):
    """Fewer work items than the threads want: each long segment is split into parts of its cache (whole blocks,
    a window's start inside the first) whose softmax states are merged; the result is the reference's."""
    got, want = long_decodes_both_backends(shapes, torch.float32, window, 3.0 if window else 0.0, threads)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def long_decodes_both_backends(shapes, q_dtype, window, softcap, threads):
    """(C kernel, reference) over a bf16 cache of blocks of 4 on ``threads`` threads: SmolLM2's heads, the new
    tokens written first."""
    from tokenmill.kernels.attention_features import AttentionFeatures

    features = AttentionFeatures(window=window, softcap=softcap)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = paged_batch(shapes, 9, 3, 64, "bf16", 4, num_blocks=700, q_dtype=q_dtype)
        write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping)
        args = (batch.q, batch.new_kv[:, :3], batch.new_kv[:, 3:], batch.data, batch.scales, batch.meta, 0.125)
        want = paged_attention(*args, backend="torch", features=features)
        batch.meta._derived.clear()
        return paged_attention(*args, backend="cpu", features=features), want
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("d", [16, 48, 64, 128])
@pytest.mark.parametrize("hq,hkv,block_size", [(9, 3, 16), (4, 4, 3), (8, 2, 1), (6, 1, 32), (20, 2, 16)])
def test_bf16_queries_over_a_bf16_cache(d, hq, hkv, block_size):
    """A bf16 model's attention (bf16 queries, bf16 cache, head size a multiple of 16): on a host with AVX512-BF16
    the kernel's bf16 path (K and V read in place, probabilities rounded to bf16 for P V), else the widening one;
    both are the reference's to bf16 precision, odd blocks and odd tails included (their unused slots hold NaN),
    head sizes that end in half a chunk of 32 (16, 48), blocks of 32 taken 16 tokens at a time, and GQA groups
    wider than one P V pass carries (10 > 8 rows)."""
    batch = paged_batch(SHAPES + [(44, 1), (17, 1)], hq, hkv, d, "bf16", block_size, num_blocks=1024,
                        q_dtype=torch.bfloat16, seed=d + block_size)
    got, want = attention_both_ways(batch, hkv, d)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)
    assert_only_probabilities_rounded(batch, hkv, d)


def assert_only_probabilities_rounded(batch, hkv, d):
    """Before the output's rounding to bf16: the float32 result and log-sum-exp of bf16 queries against the same
    queries in float32 (the widening path, exact products): only the probabilities' rounding to bf16 (relative
    error <= 2^-9 each; an fp8 cache: each times its token's V scale) separates them, so a row differs by at most
    2 * 2^-9 * max|V| (V the cache's values: code * scale for fp8); the log-sum-exp by about 2^-9."""
    segments = cpu_attention._segments(batch.meta, 0, with_prefills=True)
    rows = torch.cat([torch.arange(start, start + count) for start, count in segments[1:3].t().tolist()])
    tables = batch.meta.block_tables.long().contiguous()
    out, lse = cpu_attention.cache_attention(batch.q, batch.data, batch.scales, tables, segments, d ** -0.5)
    exact_out, exact_lse = cpu_attention.cache_attention(batch.q.float(), batch.data, batch.scales, tables, segments,
                                                         d ** -0.5)
    values = dequantize(batch.data, batch.scales, torch.float32)[:, :, hkv:]
    bound = 2 * 2 ** -9 * values.nan_to_num(0.0).abs().max().item()
    torch.testing.assert_close(out[rows], exact_out[rows], atol=bound, rtol=0)
    torch.testing.assert_close(lse[rows], exact_lse[rows], atol=2e-3, rtol=0)


@pytest.mark.parametrize("d", [16, 48, 64, 80, 128])
@pytest.mark.parametrize("hq,hkv,block_size", [(9, 3, 16), (4, 4, 3), (8, 2, 1), (6, 1, 32), (20, 2, 16)])
def test_bf16_queries_over_an_fp8_cache(d, hq, hkv, block_size):
    """A bf16 model over an fp8 cache: on a host with AVX512-BF16 and AVX512-VBMI the bf16 path over codes turned
    into bf16 by byte lookups (head sizes that end in part of a 64-code step: 16, 48, 80), else the widening one. Against
    the float32 widening path with the same queries in float32 (exact products of code * scale), as the bf16 cache's
    test holds it."""
    batch = paged_batch(SHAPES + [(44, 1), (17, 1)], hq, hkv, d, "fp8", block_size, num_blocks=1024,
                        q_dtype=torch.bfloat16, seed=d + block_size)
    got, want = attention_both_ways(batch, hkv, d)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)
    assert_only_probabilities_rounded(batch, hkv, d)


def test_the_fp8_path_is_built_where_the_cpu_has_avx512_bf16_and_vbmi(monkeypatch):
    monkeypatch.delenv(cpu_native.EXTRA_FLAGS_ENV, raising=False)  # the host's own build, as a server makes it
    flags = cpu_native.cpu_identity().split()
    assert cpu_native.library().tm_attention_fp8_path() == int(all(
        f in flags for f in ("avx512_bf16", "avx512bw", "avx512vl", "avx512vbmi")))


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 2.5)])
def test_a_decode_step_in_bf16_rounds_the_float32_result(kv_dtype, window, softcap):
    """A bf16 model's decode-only step (the kernel reads bf16 queries, strided as views of a fused projection, and
    writes bf16 itself) gives the float32 call's result rounded to nearest even, bit for bit."""
    hq, hkv, d = 9, 3, 64
    batch = paged_batch([(15, 1), (0, 1), (40, 1), (200, 1)], hq, hkv, d, kv_dtype, 16, num_blocks=256,
                        q_dtype=torch.bfloat16, seed=7)
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping)
    fused = torch.cat([batch.q.flatten(1), torch.zeros(batch.q.shape[0], 2 * hkv * d, dtype=torch.bfloat16)], 1)
    q = fused[:, :hq * d].view(-1, hq, d)  # strided rows, as the model's q is
    segments = cpu_attention._segments(batch.meta, window, with_prefills=False)
    tables = batch.meta.block_tables.long().contiguous()
    got = cpu_attention.step_attention_bf16(q, batch.data, batch.scales, cpu_attention.step_arguments(
        tables, segments), d ** -0.5, softcap)
    want, _ = cpu_attention.cache_attention(q, batch.data, batch.scales, tables, segments, d ** -0.5, softcap)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def test_a_bf16_step_of_the_decodes_beside_chunks_leaves_the_chunks_rows_zero():
    """The decodes of a step with prefill chunks (the chunks' rows another kernel's to fill): the decodes' rows are the
    float32 call's rounded, bit for bit, and the chunks' rows zero, though only the decodes' are computed."""
    hq, hkv, d = 9, 3, 64
    batch = paged_batch([(15, 1), (37, 20), (0, 1), (100, 1), (5, 9)], hq, hkv, d, "bf16", 16, num_blocks=256,
                        q_dtype=torch.bfloat16, seed=11)
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping)
    segments = cpu_attention._segments(batch.meta, 0, with_prefills=False)
    tables = batch.meta.block_tables.long().contiguous()
    got = cpu_attention.step_attention_bf16(batch.q, batch.data, None, cpu_attention.step_arguments(tables, segments),
                                            d ** -0.5)
    want, _ = cpu_attention.cache_attention(batch.q, batch.data, None, tables, segments, d ** -0.5)
    decodes = torch.zeros(got.shape[0], dtype=torch.bool)
    for row in segments[1].tolist():
        decodes[row] = True
    assert decodes.sum() == 3 and torch.equal(got[decodes], want[decodes].bfloat16())
    assert (got[~decodes] == 0).all()


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (333, 3.0)])
def test_bf16_path_split_along_the_cache(window, softcap):
    """Long bf16 decodes split into parts whose states are merged (the bf16 path's accumulators are kept in a
    permuted order of d until written out), with a window and soft-capping."""
    got, want = long_decodes_both_backends([(900, 1), (129, 1)], torch.bfloat16, window, softcap, threads=3)
    torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)


def test_the_bf16_path_is_built_where_the_cpu_has_avx512_bf16(monkeypatch):
    monkeypatch.delenv(cpu_native.EXTRA_FLAGS_ENV, raising=False)  # the host's own build, as a server makes it
    flags = cpu_native.cpu_identity().split()
    assert cpu_native.library().tm_attention_bf16_dot() == int(all(f in flags for f in ("avx512_bf16", "avx512bw",
                                                                                        "avx512vl")))


def test_merge_equals_attention_over_the_union():
    """Two partial attentions over disjoint keys, merged by log-sum-exp, are attention over all the keys."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 8, generator=gen) for _ in range(3))
    k2, v2 = torch.randn(7, 2, 8, generator=gen), torch.randn(7, 2, 8, generator=gen)

    def part(keys, values):
        scores = torch.einsum("lhd,nhd->lhn", q, keys) * 0.3
        return torch.einsum("lhn,nhd->lhd", scores.softmax(-1), values), scores.logsumexp(-1)
    merged = cpu_attention.merge(*part(k, v), *part(k2, v2))
    torch.testing.assert_close(merged, part(torch.cat([k, k2]), torch.cat([v, v2]))[0], atol=1e-6, rtol=1e-5)


def test_auto_picks_the_c_kernels_on_a_cpu_where_they_build(monkeypatch):
    import tokenmill.kernels.backend as backend

    assert backend.resolve_kernel_backend("auto", torch.device("cpu")) == "cpu"
    assert backend.resolve_kernel_backend("cpu", torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="run on a CPU"):
        backend.resolve_kernel_backend("cpu", torch.device("cuda", 0))
    monkeypatch.setattr(backend, "_cpu_kernels_build", lambda: False)
    assert backend.resolve_kernel_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="did not build"):
        backend.resolve_kernel_backend("cpu", torch.device("cpu"))


def test_a_failed_build_leaves_the_references(monkeypatch, tmp_path, caplog):
    """No compiler that works: library() is None with a warning (the engine then runs the references)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level("WARNING"):
        assert cpu_native.library(str(tmp_path / "cache")) is None
    assert "PyTorch references run instead" in caplog.text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_kv_write_equals_the_reference(dtype):
    """K/V as views of a fused projection (a token's row strided), permuted slots, a padding slot (-1): the cache
    ends as the reference leaves it, every other slot untouched."""
    from tokenmill.kernels.kv_write import write_kv_reference
    hq, hkv, d, tokens = 9, 3, 64, 5
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d).to(dtype)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    slots = torch.tensor([37, 3, -1, 16, 62], dtype=torch.int64)
    want = torch.randn(4, 16, 2 * hkv, d).to(dtype)
    got = want.clone()
    write_kv_reference(want, None, torch.cat([k, v], dim=1), slots)
    assert cpu_attention.write_kv_cpu(got, k, v, slots)
    assert torch.equal(got, want)
    with pytest.raises(IndexError):
        cpu_attention.write_kv_cpu(got, k, v, torch.tensor([1, 2, 3, 4, 64]))
    assert torch.equal(got, want)  # nothing written
    # another dtype than the cache's: the reference's job (it casts)
    assert not cpu_attention.write_kv_cpu(got, k.half(), v.half(), slots)


@pytest.fixture
def paged_prefill():
    """The "paged" prefill kernel for one test (prefill chunks as causal segments of the cache kernel)."""
    before = cpu_attention.prefill_kernel()
    cpu_attention.set_prefill_kernel("paged")
    yield
    cpu_attention.set_prefill_kernel(before)


@pytest.mark.parametrize("seed", range(8))
def test_prefill_chunks_as_causal_segments_match_reference(paged_prefill, seed, monkeypatch):
    """With the "paged" prefill kernel a bf16 model's step (decodes, prompts, chunks over a cached prefix) is one
    call of the cache kernel, each chunk a causal segment over its whole sequence, and gives the reference's
    result: head sizes that take the bf16 path (multiples of 16) and that take the widening one (40), queries and
    chunks that end inside a block, chunks longer than a tile of queries, and more than one thread."""
    gen = torch.Generator().manual_seed(100 + seed)
    pick = picker(gen)
    hq, hkv = pick([(9, 3), (8, 2), (6, 1), (4, 4), (20, 2)])
    d, block_size = pick([16, 40, 64, 128]), pick([1, 4, 16, 32])
    shapes = [(int(torch.randint(0, 70, (1,), generator=gen)), pick([1, 1, 2, 7, 19, 70]))
              for _ in range(int(torch.randint(1, 7, (1,), generator=gen)))] + [(0, 37)]
    batch = paged_batch(shapes, hq, hkv, d, "bf16", block_size, num_blocks=1024, q_dtype=torch.bfloat16, seed=seed)
    calls = []
    real = cpu_attention.step_attention_bf16
    monkeypatch.setattr(cpu_attention, "step_attention_bf16", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cpu_attention, "own_tokens_attention", lambda *a, **k: pytest.fail("an own-token pass ran"))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want = attention_both_ways(batch, hkv, d)
    finally:
        torch.set_num_threads(previous)
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])


def test_paged_prefill_leaves_other_caches_to_the_own_token_kernels(paged_prefill):
    """An fp8 cache holds the chunk's own keys quantized: its prefill chunks keep the exact own-token pass (and
    the reference's result), whatever kernel was settled."""
    batch = paged_batch([(5, 6), (0, 16), (30, 1)], 6, 2, 64, "fp8", 4, num_blocks=256, q_dtype=torch.bfloat16)
    got, want = attention_both_ways(batch, 2, 64)
    torch.testing.assert_close(got, want, atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])
