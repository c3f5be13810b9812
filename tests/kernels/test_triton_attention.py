"""Triton KV write and paged GQA attention against their PyTorch references, on paging traps (permuted block
tables, NaN in every unused slot, lengths 1 / block-aligned / unaligned, cached prefixes), fp8 and 16/32-bit
caches, and split-KV decode with the log-sum-exp merge."""

import pytest
import torch

from tests.kernels.paging import paged_batch, picker
from tests.kernels.triton_device import DEVICE
from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.paged_attention import paged_attention

# (tokens cached before this step, new tokens) per request.
SHAPES = [(0, 1), (15, 1), (0, 16), (5, 6), (40, 1), (3, 33), (31, 1), (0, 2)]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}  # bf16: two ulps (eps 2**-7)


def on_device(batch):
    batch.data, batch.q, batch.new_kv = batch.data.to(DEVICE), batch.q.to(DEVICE), batch.new_kv.to(DEVICE)
    batch.scales = None if batch.scales is None else batch.scales.to(DEVICE)
    batch.meta.slot_mapping = batch.meta.slot_mapping.to(DEVICE)
    batch.meta.block_tables = batch.meta.block_tables.to(DEVICE)
    return batch


@pytest.mark.parametrize("kv_dtype,new_dtype", [("fp8", torch.float32), ("fp8", torch.bfloat16),
                                                ("fp16", torch.float16), ("bf16", torch.bfloat16),
                                                ("fp32", torch.float32)])
def test_write_kv_matches_reference_bit_for_bit(kv_dtype, new_dtype):
    # 16-bit caches take K/V in their own dtype, as the engine computes them (the interpreter's own
    # float32 -> bfloat16 cast truncates, so a converting store is not tested here).
    batch = on_device(paged_batch(SHAPES, 4, 2, 24, kv_dtype, block_size=4, q_dtype=new_dtype))
    want_data, want_scales = batch.data.clone(), None if batch.scales is None else batch.scales.clone()
    write_kv(want_data, want_scales, batch.new_kv, batch.meta.slot_mapping, backend="torch")
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping, backend="triton")
    # Bits, so that NaN (the untouched pool) compares equal to NaN and every quantized value must agree exactly.
    assert torch.equal(batch.data.view(torch.uint8), want_data.view(torch.uint8))
    if want_scales is not None:
        assert torch.equal(batch.scales.view(torch.int32), want_scales.view(torch.int32))


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_negative_slots_write_nothing(kv_dtype):
    """CUDA-graph padding rows carry slot -1: both paths skip them and write the other rows as usual."""
    batch = on_device(paged_batch(SHAPES, 4, 2, 24, kv_dtype, block_size=4, q_dtype=torch.float32))
    slots = batch.meta.slot_mapping.clone()
    slots[::3] = -1
    before = batch.data.clone()
    results = []
    for backend in ("torch", "triton"):
        data, scales = before.clone(), None if batch.scales is None else batch.scales.clone()
        write_kv(data, scales, batch.new_kv, slots, backend=backend)
        results.append(data)
    assert torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8))
    written = results[0].view(-1, *before.shape[2:])
    untouched = before.view(-1, *before.shape[2:])
    kept = batch.meta.slot_mapping[::3]  # the rows set to -1 keep the cache's old contents at their slots
    assert torch.equal(written[kept].view(torch.uint8), untouched[kept].view(torch.uint8))
    assert not torch.equal(results[0].view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype,q_dtype", [("fp8", torch.float32), ("fp8", torch.float16),
                                              ("fp8", torch.bfloat16), ("fp16", torch.float16),
                                              ("bf16", torch.bfloat16), ("bf16", torch.float32),
                                              ("fp32", torch.float32)])
# Each dtype pair in two layouts, small blocks split three ways and large blocks whole: the interpreter takes seconds
# a case (fp8 most), and test_random_batches_match_reference below draws block sizes and splits at random.
@pytest.mark.parametrize("block_size,num_splits", [(4, 3), (16, 1)])
def test_paged_attention_matches_reference(kv_dtype, q_dtype, block_size, num_splits):
    from tokenmill.kernels.triton.paged_attention import paged_attention_triton

    hq, hkv, d = 6, 2, 40  # GQA group 3 (padded to 16 rows), head_dim not a power of two
    batch = on_device(paged_batch(SHAPES, hq, hkv, d, kv_dtype, block_size, q_dtype=q_dtype))
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping, backend="triton")
    k_new, v_new = batch.new_kv[:, :hkv], batch.new_kv[:, hkv:]
    args = (batch.q, k_new, v_new, batch.data, batch.scales, batch.meta, d ** -0.5)
    want = paged_attention(*args, backend="torch")
    got = paged_attention_triton(*args, num_splits=num_splits)
    assert not got.isnan().any()
    tol = TOLERANCE[q_dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_dispatch_runs_triton(monkeypatch):
    import tokenmill.kernels.triton.paged_attention as triton_attention

    calls = []
    real = triton_attention.paged_attention_triton
    monkeypatch.setattr(triton_attention, "paged_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    batch = on_device(paged_batch(SHAPES[:3], 4, 4, 16, "fp8", block_size=4))
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping, backend="triton")
    args = (batch.q, batch.new_kv[:, :4], batch.new_kv[:, 4:], batch.data, batch.scales, batch.meta, 0.25)
    got = paged_attention(*args, backend="triton")
    assert calls == [1]  # the dispatch really took the Triton path
    torch.testing.assert_close(got, paged_attention(*args, backend="torch"), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_match_reference(seed):
    """Random mixes of decodes and prefill chunks, head layouts, head sizes and block sizes (1 included)."""
    from tokenmill.kernels.triton.paged_attention import paged_attention_triton

    gen = torch.Generator().manual_seed(seed)
    pick = picker(gen)
    hq, hkv = pick([(4, 4), (8, 2), (6, 1), (12, 4)])
    d, block_size, kv_dtype = pick([16, 40, 64]), pick([1, 4, 8, 16]), pick(["fp8", "fp32", "fp16"])
    shapes = [(int(torch.randint(0, 50, (1,), generator=gen)), pick([1, 1, 2, 7, 19, 32]))
              for _ in range(int(torch.randint(1, 7, (1,), generator=gen)))]
    q_dtype = torch.float16 if kv_dtype == "fp16" else torch.float32
    batch = on_device(paged_batch(shapes, hq, hkv, d, kv_dtype, block_size, num_blocks=512, q_dtype=q_dtype,
                                  seed=seed))
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping, backend="triton")
    args = (batch.q, batch.new_kv[:, :hkv], batch.new_kv[:, hkv:], batch.data, batch.scales, batch.meta, d ** -0.5)
    got = paged_attention_triton(*args, num_splits=pick([1, 2, 5]))
    tol = TOLERANCE[q_dtype]
    torch.testing.assert_close(got, paged_attention(*args, backend="torch"), atol=tol, rtol=tol)
