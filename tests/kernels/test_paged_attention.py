"""The paged-attention reference against plain dense causal attention, with paging traps:
permuted block tables, NaN in every unused cache slot, lengths 1 / block-aligned / unaligned."""

import pytest
import torch

from tokenmill.kernels.kv_write import FP8_TO_FP16_FACTOR, dequantize, fp8_bits_as_fp16, quantize_fp8, write_kv
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.paged_attention import paged_attention
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheSpec


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
    torch.manual_seed(0)
    block_size, hq, hkv, d = 4, 6, 2, 16
    # (context already cached, new tokens): decode, block-aligned prefill, unaligned chunk after a prefix.
    shapes = [(0, 1), (8, 1), (0, 8), (5, 6), (13, 1), (3, 9)]
    num_blocks = 64
    cache = KVCache(KVCacheSpec.for_gqa(1, hkv, d, kv_dtype, block_size), num_blocks, "cpu")
    data, scales = cache.layer(0)
    # Every pool slot starts as NaN (0x7F in float8_e4m3fn); only the null block stays zero.
    if kv_dtype == "fp32":
        data[:num_blocks].fill_(float("nan"))
    else:
        data[:num_blocks].view(torch.uint8).fill_(0x7F)
        scales[:num_blocks].fill_(float("nan"))
    perm = torch.randperm(num_blocks).tolist()  # block tables point at scattered physical blocks
    tables, slots, qs, starts, seq_lens, refs = [], [], [], [0], [], []
    full_k, full_v = [], []
    sm_scale = d ** -0.5
    for ctx, new in shapes:
        n = ctx + new
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        k = torch.randn(n, hkv, d)
        v = torch.randn(n, hkv, d)
        positions = torch.arange(n)
        flat = torch.tensor(blocks)[positions // block_size] * block_size + positions % block_size
        write_kv(data, scales, torch.cat([k, v], dim=1)[:ctx], flat[:ctx])  # the cached prefix
        slots.append(flat[ctx:])
        q = torch.randn(new, hq, d)
        qs.append(q)
        full_k.append(k)
        full_v.append(v)
        starts.append(starts[-1] + new)
        seq_lens.append(n)
        if kv_dtype == "fp8":  # the reference sees what the cache holds ...
            kq, vq = (dequantize(*quantize_fp8(t), torch.float32) for t in (k, v))
            # ... except a prefill chunk's own tokens, which it attends unquantized.
            own = ctx if new > 1 else n
            k, v = torch.cat([kq[:own], k[own:]]), torch.cat([vq[:own], v[own:]])
        refs.append(dense_causal(q, k, v, sm_scale))
    slot_mapping = torch.cat(slots)
    new_kv = torch.cat([torch.cat([k, v], dim=1)[ctx:] for (ctx, _), k, v in zip(shapes, full_k, full_v)])
    write_kv(data, scales, new_kv, slot_mapping)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=starts, seq_lens=seq_lens,
        block_tables=torch.tensor([t + [cache.null_block] * (width - len(t)) for t in tables]), block_size=block_size,
        decode_indices=[i for i, (_, new) in enumerate(shapes) if new == 1],
        prefill_indices=[i for i, (_, new) in enumerate(shapes) if new > 1])
    out = paged_attention(torch.cat(qs), new_kv[:, :hkv], new_kv[:, hkv:], data, scales, meta, sm_scale)
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
