"""DeepSeek Sparse Attention over the paged latent cache: the lightning indexer's top-k selection and MLA attention
over only the selected tokens (DeepSeek-V3.2, GLM-5). PyTorch references (they serve both models on a CPU) and the
dispatch to the Triton path (kernels/triton/dsa.py) for ``backend="triton"``.

Cache: one slot per token, ``data[num_blocks + 1, block_size, 1, R + P + D]`` = [c_kv (R) | k_pe (P) | k_index (D,
the indexer's normalized, roped key)], MLA's slot (kernels/mla.py) with the indexer key beside it, so that the
indexer reads its keys through the same block table.

Selection, per query token t at position p (its request's tokens 0..p, causal):
    I(t, j) = sum_h w[t, h] * relu(q_index[t, h] . k_index(j)),  j <= p
and the top ``min(topk, p + 1)`` j by I (``w`` carries the indexer's softmax scale and 1/sqrt(heads); ReLU commutes
with a positive scale). When p < topk every earlier token is selected and the attention equals dense MLA.

Attention, absorbed as MLA's decode (kernels/mla.py): s_h(j) = q_lat[h] . c(j) + q_pe[h] . k_pe(j) over the selected
j only, o_lat[h] = sum_j softmax(s_h * sm_scale)(j) c(j), out_h = W_UV[h] o_lat[h]. Prefill chunks take the same
path (no [L, L] scores for the attention; the indexer's scores are [L, L] per request, one value per key).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_write import dequantize
from tokenmill.kernels.metadata import AttentionMetadata
from tokenmill.kernels.paged_attention import token_slots

# Query rows per batch of the sparse attention: bounds the gathered latents at ROWS x topk x (R + P) floats.
ROWS = 64
# The indexer's per-head scores of a block of query rows over a request's keys: at most this many bytes at once.
INDEX_SCORE_BYTES = 256 * 2**20


def _request_slots(meta: AttentionMetadata, i: int, length: int, null_slot: int) -> torch.Tensor:
    """Request i's flat cache slots of positions 0 .. length - 1 [length]."""
    lens = torch.tensor([length], device=meta.block_tables.device)
    return token_slots(meta.block_tables[i:i + 1], lens, length, meta.block_size, null_slot)[0]


def _read(data: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, features: slice) -> torch.Tensor:
    """The cache's ``features`` of each entry at flat ``slots`` [...], float32 [..., F]."""
    flat = data.view(-1, data.shape[-1])
    return dequantize(flat[slots, features], None if scales is None else scales.view(-1)[slots], torch.float32)


def index_topk_reference(q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor,
                         positions: torch.Tensor, topk: int) -> torch.Tensor:
    """One request: q_index [Q, Hi, D], weights [Q, Hi], its keys k_index [L, D], the queries' positions [Q] ->
    the selected token indices [Q, min(topk, L)], -1 where fewer than that precede the query (ties: torch.topk's)."""
    length, heads = k_index.shape[0], q_index.shape[1]
    keys = k_index.float()
    rows = max(1, INDEX_SCORE_BYTES // (4 * heads * length))  # the per-head scores of this many rows at a time
    chosen = []
    for start in range(0, q_index.shape[0], rows):
        block = slice(start, start + rows)
        scores = torch.einsum("qhd,ld->qhl", q_index[block].float(), keys).relu_()
        index = torch.einsum("qh,qhl->ql", weights[block].float(), scores)
        causal = torch.arange(length, device=index.device)[None, :] <= positions[block, None]
        picked = index.masked_fill(~causal, float("-inf")).topk(min(topk, length), dim=-1).indices
        chosen.append(torch.where(picked <= positions[block, None], picked, -1))
    return torch.cat(chosen)


def sparse_mla_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, read_latents, chosen: torch.Tensor,
                         sm_scale: float) -> torch.Tensor:
    """One request: q_lat [Q, H, R], q_pe [Q, H, P], ``read_latents(positions [q, K]) -> [q, K, R + P]`` (float32),
    the selection [Q, K] (-1: none) -> o_lat [Q, H, R] float32. Reads only the selected latents."""
    rank = q_lat.shape[-1]
    out = torch.empty(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    for start in range(0, q_lat.shape[0], ROWS):
        rows = slice(start, start + ROWS)
        picked = chosen[rows]
        gathered = read_latents(picked.clamp(min=0))  # [q, K, R + P]
        c_kv, k_pe = gathered[..., :rank], gathered[..., rank:]
        scores = (torch.einsum("qhr,qkr->qhk", q_lat[rows].float(), c_kv)
                  + torch.einsum("qhp,qkp->qhk", q_pe[rows].float(), k_pe)) * sm_scale
        scores = scores.masked_fill((picked < 0)[:, None, :], float("-inf"))
        out[rows] = torch.einsum("qhk,qkr->qhr", scores.softmax(-1), c_kv)
    return out


def _rows(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each query row's request and position in it ([T] each), and the longest of their requests (built once per
    step, shared by every layer, without reading a device tensor back)."""
    def build():
        requests, positions, longest = [], [], 1
        for i, length in enumerate(meta.seq_lens):
            count = meta.query_start_loc[i + 1] - meta.query_start_loc[i]
            requests += [i] * count
            positions += range(length - count, length)
            longest = max(longest, length) if count else longest
        return (torch.tensor(requests, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.int32, device=device), longest)
    return meta.derived(("dsa_rows", device), build)


def dsa_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, q_index: torch.Tensor | None,
                  index_weights: torch.Tensor | None, data: torch.Tensor, scales: torch.Tensor | None,
                  meta: AttentionMetadata, w_kv_b: torch.Tensor, sm_scale: float, topk: int, rope_dim: int,
                  chosen: torch.Tensor | None = None, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """The flattened batch's sparse MLA: q_nope [T, H, N], q_pe [T, H, P] (roped), the indexer's queries
    q_index [T, Hi, D] and weights [T, Hi] (a layer that runs its own indexer) or ``chosen`` [T, topk] (a layer that
    shares an earlier layer's selection), this step's entries already written to the cache -> (out [T, H, V] in q's
    dtype, the selection [T, topk], -1 padded)."""
    tokens, heads, nope = q_nope.shape
    rank = w_kv_b.shape[1]
    w = w_kv_b.view(heads, -1, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, N, R], [H, V, R]
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # W_UK absorbed, in the model's dtype as MLA's decode
    if backend == "triton":
        from tokenmill.kernels.triton.dsa import dsa_attention_triton

        requests, positions, max_len = _rows(meta, q_nope.device)
        o_lat, selection = dsa_attention_triton(q_lat, q_pe, q_index, index_weights, data, scales, meta.block_tables,
                                                requests, positions, max_len, meta.block_size, sm_scale, topk, rank,
                                                rope_dim, chosen)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv), selection
    out = torch.empty(tokens, heads, w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
    selection = torch.full((tokens, topk), -1, dtype=torch.long, device=q_nope.device) if chosen is None else chosen
    null_slot = (data.shape[0] - 1) * meta.block_size
    latent_part, index_part = slice(0, rank + rope_dim), slice(rank + rope_dim, None)
    for i in range(len(meta.seq_lens)):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if start == end:
            continue
        length = meta.seq_lens[i]
        slots = _request_slots(meta, i, length, null_slot)
        if chosen is None:  # the indexer reads every earlier key; the attention only the selected latents
            positions = torch.arange(length - (end - start), length, device=q_nope.device)
            picked = index_topk_reference(q_index[start:end], index_weights[start:end],
                                          _read(data, scales, slots, index_part), positions, topk)
            selection[start:end, :picked.shape[1]] = picked
        o_lat = sparse_mla_reference(q_lat[start:end], q_pe[start:end],
                                     lambda picked: _read(data, scales, slots[picked], latent_part),
                                     selection[start:end], sm_scale)
        out[start:end] = torch.einsum("thr,hvr->thv", o_lat.to(out.dtype), w_uv)
    return out, selection
