"""Linear layers over weights packed once for oneDNN (kernels/cpu_linear.py) and the per-shape layout table that
engine/layouts.py settles at start-up: same results as ``F.linear`` at every row count on both sides of a layer's
threshold, eagerly and compiled (one graph across the threshold), and the table's rules."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.engine import layouts
from tokenmill.kernels.cpu_linear import (
    PackedLinear,
    linear_table,
    pack_linears,
    pack_weight,
)

ROWS = (1, 2, 3, 16, 257)


def reference_linear(out_features=48, in_features=40, bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("threshold", [None, 1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_at_every_row_count(threshold, bias):
    linear = reference_linear(bias=bias)
    layer = PackedLinear(linear, threshold)
    assert layer.packed_from_rows == threshold
    assert (layer.weight is None) == (threshold == 1)  # one row and up packed: the plain copy is dropped
    for rows in ROWS:
        x = torch.randn(rows, 40)
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    x = torch.randn(2, 5, 40)  # leading dimensions are kept
    torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


def test_bfloat16_packs_where_onednn_can_and_stays_plain_where_it_cannot():
    linear = reference_linear(dtype=torch.bfloat16)
    layer = PackedLinear(linear, 1)
    assert (layer.packed_from_rows is None) == (pack_weight(linear.weight) is None)
    x = torch.randn(16, 40, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias), atol=2e-2, rtol=2e-2)


def test_compiled_graph_crosses_the_threshold_without_recompiling():
    layer = PackedLinear(reference_linear(), 4)
    compiled = torch.compile(lambda x: torch.relu(layer(x)) + 1, fullgraph=True, dynamic=True)
    with linear_table([layer]):
        compiled(torch.randn(2, 40))
    with torch.compiler.set_stance("fail_on_recompile"), linear_table([layer]):
        for rows in (3, 4, 9, 130):  # both sides of the threshold, one graph
            x = torch.randn(rows, 40)
            torch.testing.assert_close(compiled(x), torch.relu(F.linear(x, layer.weight, layer.bias)) + 1,
                                       atol=1e-5, rtol=1e-5)


def test_pack_linears_swaps_every_linear_and_keeps_shared_weights():
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(64, 40)
    model.up, model.skip_me, model.lm_head = nn.Linear(40, 48), nn.Linear(48, 40), nn.Linear(40, 64, bias=False)
    model.lm_head.weight = model.embed.weight  # tied
    model.requires_grad_(False)
    x = torch.randn(5, 40)
    want = model.lm_head(model.skip_me(model.up(x)))
    packed = pack_linears(model, {(48, 40): 1, (64, 40): 1, (40, 48): 1}, skip=("skip_me",))
    assert packed == 2 and type(model.skip_me) is nn.Linear
    assert [layer.index for layer in model.packed_linears] == [0, 1]
    assert isinstance(model.up, PackedLinear) and model.up.weight is None
    assert model.lm_head.weight is model.embed.weight  # the embedding still reads it
    torch.testing.assert_close(model.lm_head(model.skip_me(model.up(x))), want, atol=1e-5, rtol=1e-5)


def probe_with(monkeypatch, ratios):
    """packed_from_rows with the verdicts (packed / plain time, None = too noisy) given per probed row."""
    verdicts = iter(ratios)
    monkeypatch.setattr(layouts, "fastest_ratio", lambda *a, **k: next(verdicts))
    return layouts.packed_from_rows.__wrapped__(48, 40, 2, torch.float32, 1)


def test_fastest_ratio_ignores_a_neighbour_that_slows_some_samples():
    """A fake clock: A costs 1.0 and B 2.0 on a quiet machine; every third sample of either is slowed tenfold."""
    now, calls = [0.0], [0]

    def work(cost):
        def run():
            calls[0] += 1
            now[0] += cost * (10 if calls[0] % 3 == 0 else 1)
        return run
    ratio = layouts.fastest_ratio(work(1.0), work(2.0), clock=lambda: now[0], samples=9, budget_s=1e9)
    assert ratio == pytest.approx(2.0)


@pytest.mark.parametrize("ratios,threshold", [
    ((1.5, 1.2, 0.8, 0.6, 0.7, 0.9), 4),  # plain wins below 4 rows
    ((0.9, 0.8, 0.8, 0.6, 0.7, 0.9), 1),  # packed everywhere
    ((0.9, 0.8, 0.8, 0.6, 0.7, 1.1), 1),  # a loss at the largest count, outweighed by the wins below it
    ((0.9, 1.1, 0.8, 0.6, 0.7, 0.9), 4),  # a tie in sum (from 1 or from 4 rows): the larger threshold
    ((1.3, 1.2, 0.9, 0.8, 1.02, 0.8), 4),  # a near-tie lost at 64 rows does not send the threshold to 256
    ((0.8, 0.9, 1.2, 1.3, 1.4, 1.5), None),  # packed wins only at 1-2 rows: a threshold cannot say so; never
    ((1.1, 1.05, 1.02, 1.01, 1.03, 1.2), None),  # plain everywhere
    ((None, None, None, None, None, None), layouts.FALLBACK_PACKED_FROM_ROWS),  # too noisy: the known answer
    ((1.2, None, None, None, None, None), layouts.FALLBACK_PACKED_FROM_ROWS),
])
def test_threshold_makes_the_probed_times_cheapest_in_sum(monkeypatch, ratios, threshold):
    """The threshold minimizes the summed packed / plain time over the probed row counts (plain below it)."""
    assert len(ratios) == len(layouts.LAYOUT_PROBE_ROWS)
    assert probe_with(monkeypatch, ratios) == threshold
    rows = layouts.LAYOUT_PROBE_ROWS
    def summed(t):  # the relative time of a threshold, by the formula; None and unmeasured counts as 1
        return sum((r if r is not None and t is not None and n >= t else 1.0) for n, r in zip(rows, ratios))
    assert summed(threshold) <= min(summed(t) for t in (*rows, None)) + 1e-9


def test_layout_modes_and_the_memory_cap(monkeypatch):
    shapes = {(48, 40): 3, (40, 48): 3}
    assert layouts.choose_layouts("plain", shapes, torch.float32, 1) == ()
    assert layouts.choose_layouts("packed", shapes, torch.float32, 1) == ((40, 48, 1), (48, 40, 1))
    monkeypatch.setattr(layouts, "packed_from_rows", lambda out, inp, *a: 4 if out == 48 else None)
    assert layouts.choose_layouts("auto", shapes, torch.float32, 1) == ((40, 48, None), (48, 40, 4))
    monkeypatch.setattr(layouts, "available_memory", lambda: 1000)  # two copies of 48x40 no longer fit
    assert layouts.choose_layouts("auto", shapes, torch.float32, 1) == ((40, 48, None), (48, 40, 1))


def test_measured_thresholds_are_kept_for_the_next_start(monkeypatch, tmp_path):
    measured = []
    monkeypatch.setattr(layouts, "packed_from_rows", lambda out, inp, *a: measured.append((out, inp)) or 4)
    shapes = {(48, 40): 3}
    first = layouts.choose_layouts("auto", shapes, torch.float32, 1, cache_dir=str(tmp_path))
    again = layouts.choose_layouts("auto", shapes, torch.float32, 1, cache_dir=str(tmp_path))
    assert first == again == ((48, 40, 4),) and measured == [(48, 40)]  # the second start read the file
    layouts.choose_layouts("auto", shapes, torch.float32, 2, cache_dir=str(tmp_path))
    assert measured == [(48, 40), (48, 40)]  # another thread count is another measurement
