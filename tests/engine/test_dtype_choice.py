"""dtype=auto on a CPU keeps whichever of bfloat16 and float32 runs the model's linear layers faster here."""

import pytest
import torch

from tokenmill.config import load_config
from tokenmill.engine import worker


@pytest.mark.parametrize("ratios,expected", [({1: 0.5, 16: 0.6, 256: 0.3}, torch.bfloat16),  # an AMX host
                                             ({1: 1.35, 16: 2.5, 256: 8.4}, torch.float32),  # an AVX2-only host
                                             ({1: 0.8, 16: 1.1, 256: 1.3}, torch.float32)])
def test_auto_picks_the_measured_faster_dtype(monkeypatch, ratios, expected):
    monkeypatch.setattr(worker, "bf16_over_fp32_time", lambda *shape: ratios)
    assert worker.resolve_dtype(load_config(), torch.device("cpu")) == expected
    assert worker.resolve_dtype(load_config(dtype="bfloat16"), torch.device("cpu")) == torch.bfloat16
    assert worker.resolve_dtype(load_config(dtype="auto"), torch.device("cuda")) == torch.bfloat16


def test_measurement_times_both_dtypes():
    ratios = worker.bf16_over_fp32_time(64, 32, rows=(1, 8), repeats=2)
    assert set(ratios) == {1, 8} and all(r > 0 for r in ratios.values())
