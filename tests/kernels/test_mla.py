"""Absorbed MLA decode over the paged latent cache == expanded per-head attention (the textbook form)."""

import pytest
import torch

from tokenmill.kernels.kv_write import dequantize, quantize_fp8, write_kv
from tokenmill.kernels.mla import mla_decode
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheSpec


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_absorbed_decode_equals_expanded_attention(kv_dtype):
    torch.manual_seed(0)
    heads, rank, rope, nope, v_dim, block_size = 4, 32, 8, 16, 12, 4
    lens = [1, 4, 8, 11]  # length 1, block-aligned, unaligned
    num_blocks = 24
    cache = KVCache(KVCacheSpec(1, 1, rank + rope, kv_dtype, block_size), num_blocks, "cpu")
    data, scales = cache.layer(0)
    if kv_dtype == "fp32":
        data[:num_blocks].fill_(float("nan"))
    else:
        data[:num_blocks].view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
        scales[:num_blocks].fill_(float("nan"))
    w_uk, w_uv = torch.randn(heads, nope, rank) * 0.2, torch.randn(heads, v_dim, rank) * 0.2
    perm = torch.randperm(num_blocks).tolist()
    tables, q_nopes, q_pes, expected = [], [], [], []
    sm_scale = (nope + rope) ** -0.5
    for n in lens:
        blocks = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks + [cache.null_block] * (3 - len(blocks)))
        latent = torch.cat([torch.randn(n, rank), torch.randn(n, rope) * 2], dim=-1)
        pos = torch.arange(n)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        write_kv(data, scales, latent[:, None, :], slots)
        if kv_dtype == "fp8":
            latent = dequantize(*quantize_fp8(latent), torch.float32)
        c, k_pe = latent[:, :rank], latent[:, rank:]
        q_nope, q_pe = torch.randn(heads, nope), torch.randn(heads, rope)
        k = torch.cat([torch.einsum("hnr,tr->htn", w_uk, c), k_pe.expand(heads, n, rope)], dim=-1)  # [H, T, N+P]
        v = torch.einsum("hvr,tr->htv", w_uv, c)
        p = (torch.einsum("hd,htd->ht", torch.cat([q_nope, q_pe], -1), k) * sm_scale).softmax(-1)
        expected.append(torch.einsum("ht,htv->hv", p, v))
        q_nopes.append(q_nope)
        q_pes.append(q_pe)
    q_lat = torch.einsum("hnr,bhn->bhr", w_uk, torch.stack(q_nopes))  # absorb W_UK into the query
    o_lat = mla_decode(q_lat, torch.stack(q_pes), data, scales, torch.tensor(tables), torch.tensor(lens),
                       block_size, sm_scale)
    out = torch.einsum("hvr,bhr->bhv", w_uv, o_lat)  # apply W_UV after attention
    assert not out.isnan().any()
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-4)
