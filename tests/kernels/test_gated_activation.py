"""SwiGLU's gated activation (kernels/gated_activation.py, kernels/cpu/gated_activation.c) against its float32
reference: silu(gate) * up rounded once to the dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_native, gated_activation
from tokenmill.kernels.backend import KernelChoice
from tokenmill.kernels.gated_activation import silu_mul, silu_mul_reference
from tokenmill.models.layers import mlp as mlp_module
from tokenmill.models.layers.mlp import SwiGLU

needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: the CPU kernels are not built")


def exact(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64, rounded once to the input's dtype."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(gate_up.dtype)


def inputs(rows: int, inter: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * inter, generator=g) * 4
    x[0, :min(inter, 8)] = torch.tensor([-200.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])[:min(inter, 8)]
    return x.to(dtype)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between a and b (same signs assumed, as here)."""
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return (a.view(view).int() - b.view(view).int()).abs()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 17), (37, 600), (300, 1536), (2, 1)])
def test_c_kernel_matches_the_exact_value_to_one_rounding(dtype, rows, inter):
    x = inputs(rows, inter, dtype)
    out = silu_mul(x)
    want = exact(x)
    assert out.shape == (rows, inter) and out.dtype == dtype
    # float32: a few ulps (e^x is a polynomial, 1 / x one Newton step); bf16: the float32 value rounds to the exact
    # value's bf16 or, where it lies within those ulps of a rounding boundary, to its neighbour
    # Below float32's normal range (gates of -87 and less: silu ~ g e^g < 1e-36) the kernel gives ~0, not the
    # exact denormal: compared in absolute terms there.
    gate, up = x.float().chunk(2, dim=-1)
    tiny = gate < -87
    assert (out.float()[tiny].abs() <= 1e-30 * up[tiny].abs().clamp(min=1)).all()
    apart = ulps_apart(out, want)[~tiny]
    assert apart.max().item() <= (1 if dtype == torch.bfloat16 else 8)
    if dtype == torch.bfloat16:
        assert (apart > 0).float().mean().item() < 1e-3
    # the PyTorch reference (the fallback) is held to the same truth
    assert ulps_apart(silu_mul_reference(x), want)[~tiny].max().item() <= (1 if dtype == torch.bfloat16 else 8)


@needs_kernels
def test_rows_with_a_stride_and_leading_dims():
    """A view whose rows lie apart in a wider tensor, and [B, T, 2I] inputs, give what their contiguous copies do."""
    wide = inputs(40, 300, torch.bfloat16)  # [40, 600]
    view = wide[:, :512]  # rows 600 apart: gate = columns 0..255, up = 256..511
    assert not view.is_contiguous()
    assert torch.equal(silu_mul(view), silu_mul(view.contiguous()))
    batched = inputs(24, 96, torch.bfloat16).view(4, 6, 192)
    assert torch.equal(silu_mul(batched), silu_mul(batched.reshape(24, 192)).view(4, 6, 96))


@needs_kernels
def test_threads_do_not_change_the_result():
    x = inputs(64, 1536, torch.bfloat16)  # above the size that runs in parallel
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = silu_mul(x)
        torch.set_num_threads(2)
        two = silu_mul(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernels
def test_nan_stays_nan():
    x = inputs(2, 40, torch.bfloat16)
    x[1, 5] = float("nan")  # a gate
    x[1, 40 + 7] = float("nan")  # an up
    out = silu_mul(x)
    assert out[1, 5].isnan() and out[1, 7].isnan()
    assert not out[0].isnan().any()


def test_falls_back_to_the_reference_without_the_library(monkeypatch):
    monkeypatch.setattr(gated_activation, "library", lambda: None)
    x = inputs(5, 33, torch.bfloat16)
    assert torch.equal(silu_mul(x), silu_mul_reference(x))
    half = inputs(5, 33, torch.float16)  # a dtype the kernel does not take
    assert torch.equal(silu_mul(half), silu_mul_reference(half))


@needs_kernels
@pytest.mark.parametrize("compiled", [False, True])
def test_swiglu_on_the_cpu_backend_runs_the_kernel(compiled, monkeypatch):
    """The MLP with the C kernels computes down(silu(gate) * up) through the kernel: eagerly by a direct call, under
    torch.compile through the op tokenmill::silu_mul (opaque to inductor); the PyTorch backend calls neither."""
    torch.manual_seed(0)
    mlp = SwiGLU(64, 96).to(torch.bfloat16)
    x = torch.randn(7, 64).to(torch.bfloat16)
    want = F.linear(exact(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    direct = []
    monkeypatch.setattr(mlp_module, "silu_mul", lambda t: direct.append(t.shape) or silu_mul(t))
    for backend, uses_kernel in (("cpu", True), ("torch", False)):
        direct.clear()
        mlp.kernels = KernelChoice(backend=backend)
        run = torch.compile(mlp, dynamic=True) if compiled else mlp
        torch.compiler.reset()
        with torch.profiler.profile() as prof:
            got = run(x)
        as_op = any(e.key == "tokenmill::silu_mul" for e in prof.key_averages())
        assert (as_op if compiled else bool(direct)) == uses_kernel
        # the kernel rounds silu(gate) * up once, as `want` does; PyTorch's eager MLP rounds silu(gate) first
        torch.testing.assert_close(got, want, rtol=0.02, atol=0 if uses_kernel and not compiled else 4e-3)
