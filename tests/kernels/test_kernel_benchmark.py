"""benchmarks/kernel_speeds.py runs to completion (tiny shapes, through the interpreter here) and reports every
kernel."""

import importlib.util
import sys
from pathlib import Path

from tests.kernels.triton_device import DEVICE


def test_kernel_benchmark_smoke_run_prints_every_kernel(capsys, monkeypatch):
    path = Path(__file__).parents[2] / "benchmarks" / "kernel_speeds.py"
    spec = importlib.util.spec_from_file_location("kernel_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.main(["--smoke", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    kernels = {line.split(" | ")[0].removeprefix("| ") for line in table}
    assert kernels == {"kv_write fp8", "paged decode fp8 (GQA)", "MLA decode fp8", "fused MoE fp8 w8a8",
                       "fused MoE float16" if DEVICE.type == "cpu" else "fused MoE bfloat16", "linear fp8 w8a8",
                       "linear int4-g128 (weight-only)"}
    assert {line.split(" | ")[2] for line in table} == {"1", "4"}
