"""Triton fused MoE (align-to-block, gate/up GEMM with SiLU-and-mul, down GEMM with routing weights) against the
PyTorch reference: bf16/fp16/fp32 and fp8 block-quantized weights, top-k 1 and > 1, experts that get no tokens,
a single token, tile sizes that do not divide the problem; plus the launch-config tuner's on-disk cache."""

import json

import pytest
import torch

from tests.kernels.paging import picker
from tests.kernels.triton_device import DEVICE
from tokenmill.kernels.fp8 import per_token_group_quant_fp8, quantize_fp8_blocks
from tokenmill.kernels.fused_moe import Fp8BlockScales, align_routing, fused_moe


def routing(tokens, experts, top_k, gen, idle_experts=()):
    """Random distinct top-k choices per token, never choosing ``idle_experts``."""
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, list(idle_experts)] = -1.0
    weights, ids = scores.topk(top_k, dim=-1)
    return weights.float().to(DEVICE), ids.to(DEVICE)


def moe_weights(experts, inter, hidden, dtype, gen):
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype).to(DEVICE)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype).to(DEVICE)
    return w_gate_up, w_down


def test_align_routing_puts_each_pair_once_in_its_experts_tiles():
    gen = torch.Generator().manual_seed(0)
    _, ids = routing(37, 8, 3, gen, idle_experts=(2, 5))
    aligned = align_routing(ids.cpu(), 8, block_m=16)
    pairs = ids.numel()
    flat = ids.cpu().flatten()
    sorted_ids = aligned.sorted_ids.tolist()
    assert sorted(i for i in sorted_ids if i < pairs) == list(range(pairs))
    for tile, expert in enumerate(aligned.expert_ids.tolist()):
        rows = [i for i in sorted_ids[tile * 16:(tile + 1) * 16] if i < pairs]
        if expert < 0:
            assert not rows
        else:
            assert rows and all(flat[i] == expert for i in rows)
    assert 2 not in aligned.expert_ids.tolist() and 5 not in aligned.expert_ids.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 2), (23, 1), (40, 3)])
def test_fused_moe_matches_reference(dtype, tokens, top_k):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    experts, inter, hidden = 8, 48, 40  # neither a multiple of the 32/64-wide tiles
    w_gate_up, w_down = moe_weights(experts, inter, hidden, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weights, ids = routing(tokens, experts, top_k, gen, idle_experts=(3,))
    want = fused_moe(x, w_gate_up, w_down, weights, ids, backend="torch")
    got = fused_moe(x, w_gate_up, w_down, weights, ids, backend="triton")
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_other_ranks_experts_add_nothing():
    """Expert parallelism: a rank holding experts [4, 8) of 8 sees ids - 4, the others as 4 (its E): their pairs are
    skipped (their tiles get expert -1), and the result equals the whole MoE restricted to its experts."""
    gen = torch.Generator().manual_seed(7)
    w_gate_up, w_down = moe_weights(8, 48, 40, torch.float32, gen)
    x = torch.randn(23, 40, generator=gen).to(DEVICE)
    weights, ids = routing(23, 8, 3, gen)
    mine = ids >= 4
    want = fused_moe(x, w_gate_up, w_down, weights * mine, ids, backend="torch")  # others' weights zeroed
    local = torch.where(mine, ids - 4, 4)
    aligned = align_routing(local.cpu(), 4, block_m=16)
    assert set(aligned.expert_ids.tolist()) <= {-1, 0, 1, 2, 3}
    for backend in ("torch", "triton"):
        got = fused_moe(x, w_gate_up[4:], w_down[4:], weights, local, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (29, 2), (16, 1)])
def test_fp8_block_quantized_fused_moe_matches_reference(tokens, top_k):
    gen = torch.Generator().manual_seed(tokens)
    experts, inter, hidden, block = 6, 40, 48, (16, 16)  # partial scale blocks at the edges of N and K
    w_gate_up, w_down = moe_weights(experts, inter, hidden, torch.float32, gen)
    (q1, s1), (q2, s2) = quantize_fp8_blocks(w_gate_up, block), quantize_fp8_blocks(w_down, block)
    scales = Fp8BlockScales(s1, s2, block)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.float16).to(DEVICE)
    weights, ids = routing(tokens, experts, top_k, gen, idle_experts=(0,))
    want = fused_moe(x, q1, q2, weights, ids, scales, backend="torch")
    got = fused_moe(x, q1, q2, weights, ids, scales, backend="triton")
    # Only summation order differs (per-K-block partial products vs one GEMM over dequantized values), but a value
    # near a rounding boundary of the intermediate's fp8 quantization may land one fp8 step apart.
    torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)
    # The fp8 path approximates the unquantized experts (the format is right, not only self-consistent): four
    # e4m3 roundings (weights and activations of both GEMMs), each ~2-3% relative RMS error.
    exact = fused_moe(x.float(), w_gate_up, w_down, weights, ids, backend="torch")
    assert torch.linalg.norm(got.float() - exact) < 0.08 * torch.linalg.norm(exact)


def test_per_token_group_quant_matches_reference_bit_for_bit():
    x = (torch.randn(7, 40) * torch.logspace(-3, 2, 40)).to(DEVICE)  # groups of very different magnitudes
    (q_want, s_want), (q_got, s_got) = (per_token_group_quant_fp8(x, 16, backend=b) for b in ("torch", "triton"))
    assert torch.equal(q_got.view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(s_got, s_want)


TUNER_CANDIDATES = [(16, 32, 32, 1, 4, 3), (32, 16, 16, 8, 4, 3)]


def tiny_moe_problem(tokens: int = 9):
    gen = torch.Generator().manual_seed(0)
    w_gate_up, w_down = moe_weights(4, 32, 32, torch.float32, gen)
    x = torch.randn(tokens, 32, generator=gen).to(DEVICE)
    weights, ids = routing(tokens, 4, 2, gen)
    return x, w_gate_up, w_down, weights, ids


def test_tuner_measures_once_and_reuses_the_config_from_disk(tmp_path):
    from tokenmill.kernels.triton.fused_moe import fused_moe_triton
    from tokenmill.kernels.triton.moe_config import MoEConfig, MoETuner

    candidates = [MoEConfig(*c) for c in TUNER_CANDIDATES]
    calls = []

    def timer(fn):  # the second candidate is "faster"; the kernel really runs under each one
        fn()
        calls.append(1)
        return 2.0 - len(calls)

    problem = tiny_moe_problem()
    out = fused_moe_triton(*problem, tuner=MoETuner(tmp_path, timer=timer, candidates=lambda shape: candidates))
    assert len(calls) == 2
    saved = json.loads(next(tmp_path.glob("fused_moe-*.json")).read_text())
    assert list(saved.values()) == [candidates[1].__dict__]
    again = MoETuner(tmp_path, timer=timer, candidates=lambda shape: candidates)  # a new process, same disk
    out_again = fused_moe_triton(*tiny_moe_problem(tokens=12), tuner=again)  # 12 tokens: same bucket (<= 16)
    assert len(calls) == 2
    torch.testing.assert_close(out, fused_moe(*problem, backend="torch"), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_again, fused_moe(*tiny_moe_problem(tokens=12), backend="torch"), atol=1e-5,
                               rtol=1e-5)


def test_tuner_skips_configs_that_do_not_fit_the_gpu(tmp_path):
    from triton.runtime.errors import OutOfResources

    from tokenmill.kernels.triton.fused_moe import fused_moe_triton
    from tokenmill.kernels.triton.moe_config import MoEConfig, MoETuner

    candidates = [MoEConfig(*c) for c in TUNER_CANDIDATES]
    seen = []

    def first_does_not_fit(fn):  # as a launch needing more shared memory than the GPU has
        seen.append(1)
        if len(seen) == 1:
            raise OutOfResources(300_000, 232_448, "shared memory")
        fn()
        return 5.0

    def none_fits(fn):
        raise OutOfResources(300_000, 232_448, "shared memory")

    tuner = MoETuner(tmp_path / "skip", timer=first_does_not_fit, candidates=lambda shape: candidates)
    fused_moe_triton(*tiny_moe_problem(), tuner=tuner)
    assert list(json.loads(next((tmp_path / "skip").glob("*.json")).read_text()).values()) == [candidates[1].__dict__]
    with pytest.raises(RuntimeError, match="no fused MoE launch config fits"):
        fused_moe_triton(*tiny_moe_problem(),
                         tuner=MoETuner(tmp_path / "none", timer=none_fits, candidates=lambda shape: candidates))


def test_heuristic_covers_any_shape():
    from tokenmill.kernels.triton.moe_config import MoEShape, heuristic_config

    for tokens in (1, 7, 64, 300, 4096):
        for experts, inter, hidden, block in ((256, 2048, 7168, (128, 128)), (64, 1408, 2048, None),
                                              (8, 24, 40, (16, 16)), (3, 17, 33, None)):
            shape = MoEShape(tokens, experts, inter, hidden, 8 if experts > 8 else 2, "x", block)
            cfg = heuristic_config(shape)
            assert cfg.block_k >= 16 and cfg.block_n >= 16 and cfg.block_m >= 16
            if block:
                assert block[1] % cfg.block_k == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    pick = picker(gen)
    experts = pick([1, 3, 8, 16])
    top_k = int(torch.randint(1, min(experts, 4) + 1, (1,), generator=gen))
    tokens, inter, hidden = pick([1, 2, 17, 64]), pick([8, 24, 64]), pick([16, 40, 72])
    w_gate_up, w_down = moe_weights(experts, inter, hidden, torch.float32, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    weights, ids = routing(tokens, experts, top_k, gen)
    torch.testing.assert_close(fused_moe(x, w_gate_up, w_down, weights, ids, backend="triton"),
                               fused_moe(x, w_gate_up, w_down, weights, ids, backend="torch"), atol=1e-5, rtol=1e-5)
