"""Triton DeepSeek Sparse Attention (the indexer's scores + the sparse MLA decode kernel) against the PyTorch
reference of kernels/dsa.py, over a paged cache with paging traps: permuted block tables, NaN in every unused slot,
a batch mixing decodes and prefill chunks with lengths 1, index_topk, block-aligned and not, fp8 / 16 / 32-bit
caches, and a shared layer's given selection."""

import pytest
import torch

from tests.kernels.paging import block_tables, fill_pool_with_nan
from tests.kernels.triton_device import DEVICE
from tokenmill.kernels.dsa import dsa_attention
from tokenmill.kernels.kv_write import write_kv
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kvcache.cache import KVCache
from tokenmill.kvcache.spec import KVCacheSpec

RANK, ROPE, INDEX_DIM, HEADS, INDEX_HEADS, NOPE, V = 32, 8, 16, 4, 16, 16, 16
TOPK, BLOCK = 8, 4
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def batch(kv_dtype, dtype, lens, new, seed=0):
    """Requests of ``lens`` cached tokens whose last ``new`` are this step's queries."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 40
    cache = KVCache(KVCacheSpec(1, 1, RANK + ROPE + INDEX_DIM, kv_dtype, BLOCK), num_blocks, "cpu")
    data, scales = cache.layer(0)
    fill_pool_with_nan(data, scales, num_blocks)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lens:
        blocks = [perm.pop() for _ in range(-(-n // BLOCK))]
        tables.append(blocks)
        entries = torch.randn(n, RANK + ROPE + INDEX_DIM, generator=gen)
        pos = torch.arange(n)
        write_kv(data, scales, entries.to(dtype)[:, None, :], torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK)
    starts = [0]
    for q in new:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(slot_mapping=torch.zeros(starts[-1], dtype=torch.long), query_start_loc=starts,
                             seq_lens=list(lens), block_tables=block_tables(tables, cache.null_block).to(DEVICE),
                             block_size=BLOCK, decode_indices=[i for i, q in enumerate(new) if q == 1],
                             prefill_indices=[i for i, q in enumerate(new) if q > 1])
    tokens = starts[-1]
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=gen).to(dtype).to(DEVICE)
    q_pe = torch.randn(tokens, HEADS, ROPE, generator=gen).to(dtype).to(DEVICE)
    q_index = torch.randn(tokens, INDEX_HEADS, INDEX_DIM, generator=gen).to(dtype).to(DEVICE)
    weights = torch.randn(tokens, INDEX_HEADS, generator=gen).to(DEVICE)
    w_kv_b = (torch.randn(HEADS * (NOPE + V), RANK, generator=gen) * 0.2).to(dtype).to(DEVICE)
    data, scales = data.to(DEVICE), None if scales is None else scales.to(DEVICE)
    return (q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b)


LENS = [(1, 1), (8, 1), (12, 1), (13, 5), (20, 20), (9, 3)]  # (cached tokens, queries): topk, block-aligned, not


@pytest.mark.parametrize("kv_dtype,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                            ("fp8", torch.float32)])
def test_triton_matches_reference(kv_dtype, dtype):
    q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b = batch(kv_dtype, dtype, *zip(*LENS))
    args = (q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b, 0.2, TOPK, ROPE)
    want, want_sel = dsa_attention(*args, backend="torch")
    got, got_sel = dsa_attention(*args, backend="triton")
    assert not got.isnan().any() and got_sel.shape == want_sel.shape == (q_nope.shape[0], TOPK)
    for row in range(q_nope.shape[0]):
        assert set(got_sel[row].tolist()) == set(want_sel[row].tolist()), row
        valid = got_sel[row] >= 0
        assert not (got_sel[row][~valid.cumprod(0).bool()] >= 0).any()  # -1 only at the end
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_a_shared_layer_reads_the_given_selection():
    q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b = batch("fp32", torch.float32, *zip(*LENS), seed=3)
    _, chosen = dsa_attention(q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b, 0.2, TOPK, ROPE)
    args = (q_nope, q_pe, None, None, data, scales, meta, w_kv_b, 0.2, TOPK, ROPE, chosen)
    want, _ = dsa_attention(*args, backend="torch")
    got, same = dsa_attention(*args, backend="triton")
    assert same is chosen
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_ties_select_valid_tokens_and_attend_to_them():
    """Every indexer score equal (zero weights): any min(topk, position + 1) earlier tokens, none twice, none in the
    future, the -1 padding at the end; the attention over that selection equals the reference's over the same."""
    q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b = batch("fp32", torch.float32, *zip(*LENS), seed=5)
    weights = torch.zeros_like(weights)
    got, chosen = dsa_attention(q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b, 0.2, TOPK, ROPE,
                                backend="triton")
    row = 0
    for i, length in enumerate(meta.seq_lens):
        count = meta.query_start_loc[i + 1] - meta.query_start_loc[i]
        for position in range(length - count, length):
            picked = chosen[row].tolist()
            valid = [j for j in picked if j >= 0]
            assert len(valid) == len(set(valid)) == min(TOPK, position + 1) and max(valid) <= position
            assert picked[len(valid):] == [-1] * (TOPK - len(valid))
            row += 1
    want, _ = dsa_attention(q_nope, q_pe, None, None, data, scales, meta, w_kv_b, 0.2, TOPK, ROPE, chosen)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_scores_in_blocks_of_rows_select_the_same(monkeypatch):
    """The indexer's scores computed a row at a time (the memory bound's smallest block) select what all rows at once
    do, in the reference and in the Triton path."""
    import tokenmill.kernels.dsa as reference
    import tokenmill.kernels.triton.dsa as triton_path

    q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b = batch("fp32", torch.float32, *zip(*LENS), seed=7)
    args = (q_nope, q_pe, q_index, weights, data, scales, meta, w_kv_b, 0.2, TOPK, ROPE)
    whole = {backend: dsa_attention(*args, backend=backend) for backend in ("torch", "triton")}
    monkeypatch.setattr(reference, "INDEX_SCORE_BYTES", 1)
    monkeypatch.setattr(triton_path, "INDEX_SCORE_BYTES", 1)
    for backend, (out, chosen) in whole.items():
        again, chosen_again = dsa_attention(*args, backend=backend)
        assert torch.equal(chosen_again, chosen) and torch.equal(again, out), backend
