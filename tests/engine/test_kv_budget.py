"""The KV cache's byte budget: kv_cache_memory where set, on any device; unset, 2 GiB on a CPU and on a GPU the
gpu_memory_utilization share of its memory less what is in use (as vLLM's kv_cache_memory_bytes and
gpu_memory_utilization)."""

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.build import kv_budget

GIB = 2**30


def test_a_cpu_takes_the_setting_or_two_gib():
    assert kv_budget(EngineConfig(), torch.device("cpu")) == 2 * GIB
    assert kv_budget(EngineConfig(kv_cache_memory="300MiB"), torch.device("cpu")) == 300 * 2**20


def test_a_gpu_takes_its_utilization_share_unless_the_setting_is_given(monkeypatch):
    # 100 GiB in all, 30 free: weights and other processes hold 70 GiB.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GIB, 100 * GIB))
    gpu = torch.device("cuda", 0)
    assert kv_budget(EngineConfig(gpu_memory_utilization=0.9), gpu) == 90 * GIB - 70 * GIB
    assert kv_budget(EngineConfig(kv_cache_memory="256MiB"), gpu) == 256 * 2**20
