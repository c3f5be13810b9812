"""Every Triton kernel, launched by the real host code at real model shapes (SmolLM2, Llama-3-8B, DeepSeek-V3 MLA
and MoE, DeepSeek-V2-Lite MoE; decode and prefill regimes; fp8 and bf16), compiles to a cubin for Hopper (sm_90:
H100/H200) and, without fp8, for Ampere (sm_80: A100), and fits the target's shared memory. No GPU is needed:
tests/kernels/gpu_compile.py compiles instead of launching."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton kernels are compiled where triton installs (Linux)")

ROOT = Path(__file__).parents[2]
MAX_SHARED_BYTES = {90: 227 * 1024, 80: 163 * 1024}  # per block, opt-in maximum
KERNELS = {"_write_kv_kernel", "_decode_split_kernel", "_merge_splits_kernel", "_prefill_kernel",
           "_mla_decode_split_kernel", "_moe_gemm_kernel"}


ARCHS = (90, 80)


@pytest.fixture(scope="module")
def compilations(tmp_path_factory):
    """Both targets' compilations, started together: each is one single-threaded process (Triton's front end, then
    ptxas), so on a machine of two cores or more they overlap (CI time) without changing what either compiles."""
    running = {}
    for arch in ARCHS:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp(f"sm{arch}")),
               "TRITON_DEFAULT_FP_FUSION": "1"}
        script = ROOT / "tests" / "kernels" / "gpu_compile.py"
        running[arch] = subprocess.Popen([sys.executable, str(script), str(arch)], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=env)
    yield running
    for process in running.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile_for_gpu_targets_and_fit_shared_memory(arch, compilations):
    stdout, stderr = compilations[arch].communicate(timeout=600)  # a timeout: the fixture kills both
    assert compilations[arch].returncode == 0, stderr[-4000:]
    compiled = json.loads(stdout)
    expected = KERNELS | ({"_group_quant_kernel"} if arch >= 89 else set())  # fp8 activations: Hopper only
    assert {c["kernel"] for c in compiled} == expected
    assert all(c["cubin_bytes"] > 0 for c in compiled)
    too_big = [c for c in compiled if c["shared_bytes"] > MAX_SHARED_BYTES[arch]]
    assert not too_big, too_big
    cases = {c["case"] for c in compiled}
    assert any("DeepSeek-V3 MLA 128 heads" in c for c in cases) and any("2048 tokens" in c for c in cases)
    if arch >= 89:
        assert any("fp8" in c for c in cases)
