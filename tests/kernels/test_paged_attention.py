"""The paged-attention reference against plain dense causal attention, with paging traps:
permuted block tables, NaN in every unused cache slot, lengths 1 / block-aligned / unaligned."""

import pytest
import torch

from tokenmill.kernels.kv_write import FP8_TO_FP16_FACTOR, dequantize, fp8_bits_as_fp16, quantize_fp8, write_kv
from tokenmill.kernels.paged_attention import paged_attention
from tests.kernels.paging import paged_batch


def dense_causal(q, k, v, sm_scale):
    """q [L, Hq, D], k/v [N, Hkv, D] -> [L, Hq, D]; the last L keys are the queries' own positions."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,nhd->hln", q, k) * sm_scale
    n, l = k.shape[0], q.shape[0]
    mask = torch.arange(n)[None, :] <= torch.arange(n - l, n)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hln,nhd->lhd", scores.softmax(-1), v)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_mixed_batch_matches_dense(kv_dtype):
    hq, hkv, d = 6, 2, 16
    # (context already cached, new tokens): decode, block-aligned prefill, unaligned chunk after a prefix.
    shapes = [(0, 1), (8, 1), (0, 8), (5, 6), (13, 1), (3, 9)]
    batch = paged_batch(shapes, hq, hkv, d, kv_dtype, block_size=4)
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping)
    sm_scale = d ** -0.5
    refs, q_rows = [], batch.q.split([new for _, new in shapes])
    for (ctx, new), q, k, v in zip(shapes, q_rows, batch.full_k, batch.full_v):
        if kv_dtype == "fp8":  # the reference sees what the cache holds ...
            kq, vq = (dequantize(*quantize_fp8(t), torch.float32) for t in (k, v))
            # ... except a prefill chunk's own tokens, which it attends unquantized.
            own = ctx if new > 1 else ctx + new
            k, v = torch.cat([kq[:own], k[own:]]), torch.cat([vq[:own], v[own:]])
        refs.append(dense_causal(q, k, v, sm_scale))
    out = paged_attention(batch.q, batch.new_kv[:, :hkv], batch.new_kv[:, hkv:], batch.data, batch.scales,
                          batch.meta, sm_scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)


def test_fp8_bit_trick_is_exact_for_every_finite_value():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~every.float().isnan()
    got = fp8_bits_as_fp16(every).float() * FP8_TO_FP16_FACTOR
    assert torch.equal(got[finite], every.float()[finite])


def test_fp8_roundtrip_error_is_small():
    x = torch.randn(100, 4, 64) * 3
    q, s = quantize_fp8(x)
    rel = (dequantize(q, s, torch.float32) - x).abs().max() / x.abs().max()
    assert rel < 0.07  # e4m3 has a 3-bit mantissa: half an ulp is 1/16
