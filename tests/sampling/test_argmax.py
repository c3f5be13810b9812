"""The C argmax of greedy sampling (kernels/cpu/argmax.c) against torch.argmax: ties (the first position), NaN (the
first NaN wins), rows of -inf, one column, and enough rows to split across threads."""

import pytest
import torch

from tokenmill.kernels.argmax import argmax_rows
from tokenmill.kernels.cpu_native import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler: the CPU kernels are not built")


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (32, 49152), (7, 1000)])
def test_matches_torch_argmax(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    logits = torch.randn(rows, cols, generator=g)
    logits[0, cols // 2] = logits[0, -1] = 1e9  # a tie: the first position
    if rows > 2:
        logits[1] = float("-inf")
        logits[2, cols // 3] = float("nan")
        logits[2, cols - 1] = float("nan")
        logits[2, 0] = float("inf")
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))


def test_falls_back_to_torch_where_the_kernel_does_not_apply():
    logits = torch.randn(4, 64)
    for view in (logits.t(), logits.bfloat16(), logits[None]):
        assert torch.equal(argmax_rows(view), view.argmax(-1))
    assert torch.equal(argmax_rows(logits, use_c=False), logits.argmax(-1))
