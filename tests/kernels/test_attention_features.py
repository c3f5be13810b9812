"""Sliding windows, soft-capping and attention sinks as parameters of the one attention op: the reference against a
dense formula written here from the definitions (kernels/attention_features.py), and the CPU kernel and the Triton
kernels (TRITON_INTERPRET=1 on CPU) against the reference, on the paging traps of tests/kernels/paging.py: permuted
block tables, NaN in every unused slot, lengths 1 / window-aligned / not, windows shorter than a block."""

import pytest
import torch

from tests.kernels.paging import paged_batch
from tokenmill.kernels import cpu_native
from tokenmill.kernels.attention_features import AttentionFeatures
from tokenmill.kernels.kv_write import dequantize, quantize_fp8, write_kv
from tokenmill.kernels.paged_attention import paged_attention

# (tokens cached before this step, new tokens) per request, with block size 4 and windows 3 / 4 / 8: decodes
# inside and past the window, window-aligned and unaligned chunks, chunks longer than the window after a prefix.
SHAPES = [(0, 1), (2, 1), (7, 1), (8, 1), (30, 1), (0, 8), (5, 6), (3, 13), (16, 4), (0, 2)]
FEATURES = [AttentionFeatures(window=3), AttentionFeatures(window=4), AttentionFeatures(window=8, softcap=2.5),
            AttentionFeatures(softcap=1.5), "sinks", "window+sinks"]
HQ, HKV, D = 6, 2, 16


def features_for(kind) -> AttentionFeatures:
    if isinstance(kind, AttentionFeatures):
        return kind
    sinks = torch.linspace(-1.0, 2.0, HQ)
    return AttentionFeatures(window=5 if kind == "window+sinks" else 0, sinks=sinks)


def dense(q, k, v, sm_scale, f: AttentionFeatures):
    """One query at a time from the definitions: q [L, Hq, D], k/v [N, Hkv, D], queries the last L positions."""
    group, n, length = q.shape[1] // k.shape[1], k.shape[0], q.shape[0]
    out = torch.empty(length, q.shape[1], v.shape[-1])
    for i in range(length):
        p = n - length + i
        lo = max(0, p - f.window + 1) if f.window else 0
        for h in range(q.shape[1]):
            s = (k[lo:p + 1, h // group] @ q[i, h]) * sm_scale
            if f.softcap:
                s = f.softcap * torch.tanh(s / f.softcap)
            e = torch.exp(s - s.max())
            denominator = e.sum() + (torch.exp(f.sinks[h] - s.max()) if f.sinks is not None else 0.0)
            out[i, h] = (e / denominator) @ v[lo:p + 1, h // group]
    return out


def batch_and_args(kv_dtype):
    batch = paged_batch(SHAPES, HQ, HKV, D, kv_dtype, block_size=4, num_blocks=128)
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping)
    return batch, (batch.q, batch.new_kv[:, :HKV], batch.new_kv[:, HKV:], batch.data, batch.scales, batch.meta,
                   D ** -0.5)


@pytest.mark.parametrize("kind", FEATURES, ids=str)
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_reference_matches_the_definitions(kind, kv_dtype):
    f = features_for(kind)
    batch, args = batch_and_args(kv_dtype)
    want = []
    for (ctx, new), q, k, v in zip(SHAPES, batch.q.split([n for _, n in SHAPES]), batch.full_k, batch.full_v):
        if kv_dtype == "fp8":  # what the cache holds, except a prefill chunk's own tokens (attended as computed)
            kq, vq = (dequantize(*quantize_fp8(t), torch.float32) for t in (k, v))
            own = ctx if new > 1 else ctx + new
            k, v = torch.cat([kq[:own], k[own:]]), torch.cat([vq[:own], v[own:]])
        want.append(dense(q, k, v, D ** -0.5, f))
    got = paged_attention(*args, features=f)
    assert not got.isnan().any()
    torch.testing.assert_close(got, torch.cat(want), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("kind", FEATURES, ids=str)
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_cpu_kernel_matches_reference(kind, kv_dtype):
    f = features_for(kind)
    batch, args = batch_and_args(kv_dtype)
    want = paged_attention(*args, features=f)
    batch.meta._derived.clear()
    got = paged_attention(*args, backend="cpu", features=f)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# The interpreter is slow: a window shorter than a block with the cap over split decodes, sinks with a window over
# splits and without either.
@pytest.mark.parametrize("kind,num_splits", [(AttentionFeatures(window=3, softcap=2.5), 3), ("window+sinks", 3),
                                             ("sinks", 1)], ids=str)
def test_triton_matches_reference(kind, num_splits):
    pytest.importorskip("triton")
    from tests.kernels.test_triton_attention import on_device
    from tokenmill.kernels.triton.paged_attention import paged_attention_triton

    f = features_for(kind)
    batch = on_device(paged_batch(SHAPES, HQ, HKV, D, "fp8", block_size=4, num_blocks=128))
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping, backend="triton")
    if f.sinks is not None:
        f = AttentionFeatures(f.window, f.softcap, f.sinks.to(batch.q.device))
    args = (batch.q, batch.new_kv[:, :HKV], batch.new_kv[:, HKV:], batch.data, batch.scales, batch.meta, D ** -0.5)
    want = paged_attention(*args, features=f)
    got = paged_attention_triton(*args, num_splits=num_splits, features=f)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
