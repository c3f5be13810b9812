"""The KV cache's byte budget: kv_cache_memory where set, on any device; unset, 2 GiB on a CPU and on a GPU the
gpu_memory_utilization share of its memory less what is in use (as vLLM's kv_cache_memory_bytes and
gpu_memory_utilization); a budget too small says which setting to raise."""

import pytest
import torch

from tokenmill import LLM
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.build import kv_budget

GIB = 2**30


def test_a_cpu_takes_the_setting_or_two_gib():
    assert kv_budget(EngineConfig(), torch.device("cpu")).bytes == 2 * GIB
    small = kv_budget(EngineConfig(kv_cache_memory="300MiB"), torch.device("cpu"))
    assert (small.bytes, small.setting, small.detail) == (300 * 2**20, "kv_cache_memory", "kv_cache_memory=300.0 MiB")


def test_a_gpu_takes_its_utilization_share_unless_the_setting_is_given(monkeypatch):
    # 100 GiB in all, 30 free: weights and other processes hold 70 GiB.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 100 * GIB))
    gpu = torch.device("cuda", 0)
    share = kv_budget(EngineConfig(gpu_memory_utilization=0.9), gpu)
    assert (share.bytes, share.setting) == (90 * GIB - 70 * GIB, "gpu_memory_utilization")
    assert share.detail == ("gpu_memory_utilization=0.9 of 100.0 GiB, 70.0 GiB of it in use by the weights, other "
                            "engines and other processes")
    assert kv_budget(EngineConfig(gpu_memory_utilization=0.5), gpu).bytes < 0  # nothing left: no block
    assert kv_budget(EngineConfig(kv_cache_memory="256MiB"), gpu).bytes == 256 * 2**20


def test_too_small_a_budget_names_the_setting_to_raise():
    with pytest.raises(ConfigError, match=r"no room for a single KV block \(\d+ bytes, and one more for the null "
                                          r"block; kv_cache_memory=1024 bytes\): raise kv_cache_memory"):
        LLM(kv_cache_memory="1KiB", enforce_eager=True)
    # Room for a few blocks, not for the requested length.
    with pytest.raises(ConfigError, match=r"the KV cache holds \d+ tokens \(\d+ bytes each; kv_cache_memory=1.0 MiB\)"
                                          r", fewer than max_model_len=2048: raise kv_cache_memory, or lower"):
        LLM(kv_cache_memory="1MiB", max_model_len=2048, enforce_eager=True)
