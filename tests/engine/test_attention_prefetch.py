"""The CPU attention kernel's prefetch target (kernels/cpu/paged_attention.c, engine/attention_prefetch.py): where
the next cache block is asked to go changes nothing the kernel computes, and the start-up measurement keeps the L2
target only when it is clearly faster."""

import pytest
import torch

from tests.engine.test_settle import scripted
from tests.kernels.paging import paged_batch
from tokenmill.engine import attention_prefetch
from tokenmill.kernels import cpu_attention
from tokenmill.kernels.kv_write import write_kv


@pytest.fixture
def restore_target():
    before = cpu_attention.prefetch_target()
    yield
    cpu_attention.set_prefetch_target(before)


@pytest.mark.parametrize("kv,q_dtype", [("bf16", torch.bfloat16), ("bf16", torch.float32), ("fp8", torch.bfloat16),
                                        ("fp32", torch.float32)])
def test_the_target_changes_no_result(restore_target, kv, q_dtype):
    batch = paged_batch([(300, 1), (77, 1), (40, 5)], 8, 2, 64, kv, 16, num_blocks=64, q_dtype=q_dtype)
    write_kv(batch.data, batch.scales, batch.new_kv, batch.meta.slot_mapping)  # the decodes' own tokens
    segments = cpu_attention._segments(batch.meta, 0, with_prefills=True)
    tables = batch.meta.block_tables.long().contiguous()
    results = {}
    for target in ("l1", "l2"):
        cpu_attention.set_prefetch_target(target)
        assert cpu_attention.prefetch_target() == target
        results[target] = cpu_attention.cache_attention(batch.q, batch.data, batch.scales, tables, segments, 0.125)
    rows = torch.cat([torch.arange(start, start + count) for start, count in segments[1:3].t().tolist()])
    for got, want in zip(results["l2"], results["l1"]):
        assert got[rows].isfinite().all() and torch.equal(got[rows], want[rows])


def test_an_unknown_target_is_refused():
    with pytest.raises(ValueError, match="l3"):
        cpu_attention.set_prefetch_target("l3")


@pytest.mark.parametrize("l2_over_l1,expected", [([0.80], "l2"), ([0.97], "l1"), ([1.3], "l1")])
def test_the_l2_target_only_where_clearly_faster(monkeypatch, l2_over_l1, expected):
    monkeypatch.setattr(attention_prefetch, "time_l2_over_l1", scripted(l2_over_l1))
    args = (9, 3, 64, 16, "bf16", torch.bfloat16, 2)
    assert attention_prefetch.choose_attention_prefetch("auto", "cpu", "cpu", *args) == expected
    assert attention_prefetch.choose_attention_prefetch("l1", "cpu", "cpu", *args) == "l1"  # as configured
    assert attention_prefetch.choose_attention_prefetch("l2", "cpu", "cpu", *args) == "l2"


def test_too_noisy_or_no_c_kernel_keeps_the_l1_target(monkeypatch):
    monkeypatch.setattr(attention_prefetch, "time_l2_over_l1", scripted([0.8], noisy=True))
    assert attention_prefetch.choose_attention_prefetch("auto", "cpu", "cpu", 9, 3, 64, 16, "bf16",
                                                        torch.bfloat16, 2) == "l1"

    def not_timed(*args, **kwargs):
        raise AssertionError("nothing to time where the C attention kernel does not run")
    monkeypatch.setattr(attention_prefetch, "time_l2_over_l1", not_timed)
    for device, backend, kv_heads in (("cuda", "triton", 3), ("cpu", "torch", 3), ("cpu", "cpu", 0)):  # 0: MLA
        assert attention_prefetch.choose_attention_prefetch("auto", device, backend, 9, kv_heads, 64, 16, "bf16",
                                                            torch.bfloat16, 2) == "l1"


def test_the_measurement_times_the_kernel_and_restores_what_it_changed(restore_target):
    cpu_attention.set_prefetch_target("l2")
    threads = torch.get_num_threads()
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        result = attention_prefetch.time_l2_over_l1(4, 2, 32, 16, kv, torch.bfloat16, 1, budget_s=0.3,
                                                    cache_bytes=2**20)
        assert result.rounds and all(r > 0 for r in result.rounds)
    assert cpu_attention.prefetch_target() == "l2" and torch.get_num_threads() == threads


def test_the_last_level_cache_is_read_from_sysfs(monkeypatch, tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "65536K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    monkeypatch.setattr(attention_prefetch, "CPU_CACHE_DIR", tmp_path)
    assert attention_prefetch.last_level_cache_bytes() == 64 * 2**20
    monkeypatch.setattr(attention_prefetch, "CPU_CACHE_DIR", tmp_path / "missing")
    assert attention_prefetch.last_level_cache_bytes() == 32 * 2**20  # the fallback
