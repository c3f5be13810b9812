import torch

from tokenmill.models.layers.logits import REFINED_CANDIDATES, logits_with_exact_top


def test_top_candidates_equal_a_float32_gemm():
    torch.manual_seed(0)
    hidden = torch.randn(5, 64).bfloat16()
    weight = (torch.randn(1000, 64) * 0.5).bfloat16()
    exact = hidden.float() @ weight.float().T
    got = logits_with_exact_top(hidden, weight)
    top = exact.topk(REFINED_CANDIDATES // 2, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    plain = (hidden @ weight.T).float()
    assert (plain - exact).abs().max() > 1e-3  # the bf16 GEMM alone really is rounded
    assert (got - exact).abs().max() <= (plain - exact).abs().max()
