"""Rotary embeddings of queries and keys (kernels/rotary.py, kernels/cpu/rotary.c) against the exact rotation: the
neox / HF rotate_half pairs in float64, rounded once to the dtype; and against transformers' own apply_rotary_pos_emb."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu_native, rotary as rotary_kernels
from tokenmill.kernels.rotary import rope_qk, rotate_reference
from tokenmill.models.layers.rotary import RotaryEmbedding

needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: the CPU kernels are not built")

LLAMA3 = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def exact(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation in float64 from the float32 tables, rounded once to x's dtype."""
    half = cos.shape[-1]
    c, s = cos[positions].double().unsqueeze(1), sin[positions].double().unsqueeze(1)
    x1, x2, rest = x[..., :half].double(), x[..., half:2 * half].double(), x[..., 2 * half:].double()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between a and b (for values of one sign, or both ~0)."""
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return (a.view(view).int() - b.view(view).int()).abs()


def qkv(tokens: int, hq: int, hk: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """q and k as the attention layer has them: strided views into one fused projection's rows [q | k | v]."""
    g = torch.Generator().manual_seed(seed)
    fused = (torch.randn(tokens, (hq + 2 * hk) * dim, generator=g) * 3).to(dtype)
    q, k, _ = fused.split([hq * dim, hk * dim, hk * dim], dim=-1)
    return q.view(tokens, hq, dim), k.view(tokens, hk, dim)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hq,hk,dim,rot", [(1, 9, 3, 64, 64), (37, 4, 2, 128, 128), (300, 9, 3, 64, 64),
                                                  (5, 8, 1, 80, 40), (3, 2, 2, 6, 2)])
def test_c_kernel_matches_the_exact_rotation_to_one_rounding(dtype, tokens, hq, hk, dim, rot):
    rotary = RotaryEmbedding(rot, 4096, LLAMA3 if rot % 4 == 0 else {"rope_theta": 10000.0, "rope_type": "default"})
    q, k = qkv(tokens, hq, hk, dim, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(1))
    got_q, got_k = rope_qk(q, k, positions, rotary.cos, rotary.sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.is_contiguous() and got_k.is_contiguous()
    for got, x in ((got_q, q), (got_k, k)):
        want = exact(x, positions, rotary.cos, rotary.sin)
        # the PyTorch reference (the fallback) is held to the same truth as the kernel
        for candidate in (got, rotate_reference(x, positions, rotary.cos, rotary.sin)):
            if dtype == torch.bfloat16:
                # the float32 value rounds to the exact value's bf16 or, within a float32 error of a rounding
                # boundary, to its neighbour
                apart = ulps_apart(candidate, want)
                assert apart.max().item() <= 1 and (apart > 0).float().mean().item() < 1e-3
            else:
                # the products and their sum each rounded (or fused): a few ulps of the larger term, which near a
                # cancellation is many ulps of the result, so measured against the terms' size
                torch.testing.assert_close(candidate.double(), want.double(), rtol=0,
                                           atol=3 * 2 ** -23 * x.abs().max().item())
        assert torch.equal(got[..., rot:], x[..., rot:])  # features past the rotary dim are copied


def test_reference_matches_transformers():
    """The reference is transformers' apply_rotary_pos_emb (Llama's) on the same cos / sin."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = RotaryEmbedding(64, 2048, LLAMA3)
    q, k = qkv(11, 4, 2, 64, torch.float32)
    positions = torch.arange(100, 111)
    cos = torch.cat([rotary.cos[positions]] * 2, dim=-1)[None]  # HF: [B, T, D], halves repeated
    sin = torch.cat([rotary.sin[positions]] * 2, dim=-1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(rotate_reference(q, positions, rotary.cos, rotary.sin), hf_q[0].transpose(0, 1))
    torch.testing.assert_close(rotate_reference(k, positions, rotary.cos, rotary.sin), hf_k[0].transpose(0, 1))


@needs_kernels
def test_threads_do_not_change_the_result():
    rotary = RotaryEmbedding(64, 1024, {"rope_theta": 10000.0, "rope_type": "default"})
    q, k = qkv(200, 9, 3, 64, torch.bfloat16)
    positions = torch.arange(200)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rope_qk(q, k, positions, rotary.cos, rotary.sin)
        torch.set_num_threads(2)
        two = rope_qk(q, k, positions, rotary.cos, rotary.sin)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@needs_kernels
def test_a_position_outside_the_table_is_an_error_and_writes_nothing():
    rotary = RotaryEmbedding(64, 16, {"rope_theta": 10000.0, "rope_type": "default"})
    q, k = qkv(3, 2, 1, 64, torch.bfloat16)
    for bad in (16, -1):
        with pytest.raises(IndexError, match="position"):
            rope_qk(q, k, torch.tensor([0, bad, 2]), rotary.cos, rotary.sin)


def test_falls_back_to_the_reference_without_the_library(monkeypatch):
    monkeypatch.setattr(rotary_kernels, "library", lambda: None)
    rotary = RotaryEmbedding(64, 256, {"rope_theta": 10000.0, "rope_type": "default"})
    q, k = qkv(5, 3, 1, 64, torch.float16)
    positions = torch.arange(5)
    got_q, got_k = rope_qk(q, k, positions, rotary.cos, rotary.sin)
    assert torch.equal(got_q, rotate_reference(q, positions, rotary.cos, rotary.sin))
    assert torch.equal(got_k, rotate_reference(k, positions, rotary.cos, rotary.sin))


@needs_kernels
@pytest.mark.parametrize("compiled", [False, True])
def test_apply_qk_on_the_cpu_backend_runs_the_kernel(compiled, monkeypatch):
    """With the C kernels the rotation runs through the kernel: eagerly by a direct call, under torch.compile
    through the op tokenmill::rope_qk (opaque to inductor); the PyTorch backend calls neither."""
    from tokenmill.models.layers import rotary as rotary_layer

    rotary = RotaryEmbedding(64, 512, LLAMA3)
    q, k = qkv(7, 9, 3, 64, torch.bfloat16)
    positions = torch.arange(40, 47)
    want_q, want_k = exact(q, positions, rotary.cos, rotary.sin), exact(k, positions, rotary.cos, rotary.sin)
    direct = []
    monkeypatch.setattr(rotary_layer, "rope_qk", lambda *a: direct.append(1) or rope_qk(*a))
    for backend, uses_kernel in (("cpu", True), ("torch", False)):
        direct.clear()

        def step(q, k, positions):
            return rotary.apply_qk(q, k, positions, backend)

        run = torch.compile(step, dynamic=True) if compiled else step
        torch.compiler.reset()
        with torch.profiler.profile() as prof:
            got_q, got_k = run(q, k, positions)
        as_op = any(e.key == "tokenmill::rope_qk" for e in prof.key_averages())
        assert (as_op if compiled else bool(direct)) == uses_kernel
        assert ulps_apart(got_q, want_q).max().item() <= 1 and ulps_apart(got_k, want_k).max().item() <= 1


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_on_the_fused_projection_rotates_q_and_k_and_leaves_v(dtype):
    """rope_qk_inplace on a [T, q | k | v] output gives rope_qk's q and k where they lie and the same v."""
    rotary = RotaryEmbedding(64, 1024, LLAMA3)
    tokens, hq, hk, dim = 33, 9, 3, 64
    fused = (torch.randn(tokens, (hq + 2 * hk) * dim, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    before = fused.clone()
    positions = torch.randint(0, 1024, (tokens,), generator=torch.Generator().manual_seed(4))
    q, k, _ = before.split([hq * dim, hk * dim, hk * dim], dim=-1)
    want_q, want_k = rope_qk(q.view(tokens, hq, dim), k.view(tokens, hk, dim), positions, rotary.cos, rotary.sin)
    got = rotary_kernels.rope_qk_inplace(fused, positions, rotary.cos, rotary.sin, hq, hk)
    assert got.data_ptr() == fused.data_ptr()
    assert torch.equal(got[:, :hq * dim], want_q.flatten(1))
    assert torch.equal(got[:, hq * dim:(hq + hk) * dim], want_k.flatten(1))
    assert torch.equal(got[:, (hq + hk) * dim:], before[:, (hq + hk) * dim:])


@needs_kernels
def test_fused_projection_op_is_the_projection_then_the_rotation():
    """tokenmill::cpu_linear_rope (the compiled graph's qkv projection on a CPU) equals the layer's own output
    rotated by the reference, to one bf16 rounding."""
    from tokenmill.kernels.cpu_linear import PackedLinear, linear_table

    torch.manual_seed(0)
    rotary = RotaryEmbedding(64, 512, LLAMA3)
    hq, hk, dim = 4, 2, 64
    layer = PackedLinear(torch.nn.Linear(96, (hq + 2 * hk) * dim, bias=True).to(torch.bfloat16), packed_from_rows=None)
    x = torch.randn(6, 96).to(torch.bfloat16)
    positions = torch.tensor([0, 5, 17, 100, 300, 511])
    with linear_table([layer]):
        got = torch.ops.tokenmill.cpu_linear_rope(x, 0, positions, rotary.cos, rotary.sin, hq, hk, (hq + 2 * hk) * dim)
    plain = layer.run(x)
    q, k, v = plain.split([hq * dim, hk * dim, hk * dim], dim=-1)
    want_q = exact(q.reshape(6, hq, dim), positions, rotary.cos, rotary.sin).flatten(1)
    want_k = exact(k.reshape(6, hk, dim), positions, rotary.cos, rotary.sin).flatten(1)
    assert ulps_apart(got[:, :hq * dim], want_q).max().item() <= 1
    assert ulps_apart(got[:, hq * dim:(hq + hk) * dim], want_k).max().item() <= 1
    assert torch.equal(got[:, (hq + hk) * dim:], v)


def test_in_place_rejects_features_that_are_not_whole_heads():
    rotary = RotaryEmbedding(64, 16, {"rope_theta": 10000.0, "rope_type": "default"})
    with pytest.raises(ValueError, match="heads"):
        rotary_kernels.rope_qk_inplace(torch.zeros(2, 301), torch.arange(2), rotary.cos, rotary.sin, 2, 1)
