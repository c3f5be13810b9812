"""Settling the configuration's open choices before the model is built (engine/settle.py), and the start-up
measurements behind the CPU's dtype and thread count (engine/probe.py), fed a scripted timer: quiet, busy for a
while, and noisy throughout (then the hardware's known answer is used)."""

import math
import random

import pytest
import torch

from tokenmill.config import load_config
from tokenmill.engine import probe, settle
from tokenmill.models.config import ModelConfig


class FakeClock:
    """Time that passes only when scripted work runs: ``work(name)`` advances it by the next duration ``durations``
    gives for ``name``, and records the call."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, durations, []

    def __call__(self) -> float:
        return self.now

    def work(self, name):
        def run():
            self.calls.append(name)
            self.now += self.durations(name, len(self.calls))
        return run


def pairs(clock, cases):
    return [(clock.work(f"a{i}"), clock.work(f"b{i}")) for i in range(cases)]


def test_a_quiet_machine_agrees_in_two_interleaved_rounds():
    clock = FakeClock(lambda name, _: 1.0 if name.startswith("a") else 0.5)
    result = probe.compare(pairs(clock, 2), clock=clock, budget_s=100)
    assert result.ratio == pytest.approx(0.5) and len(result.rounds) == 2
    assert clock.calls == ["a0", "b0", "a1", "b1", "b0", "a0", "b1", "a1"]  # the order alternates by round


def test_a_neighbour_busy_for_a_while_is_waited_out():
    """For the first 12 calls a neighbour slows each call by a random factor of up to 3x; then it is quiet."""
    rng = random.Random(1)

    def durations(name, call):
        base = 1.0 if name.startswith("a") else 2.0
        return base * (1 + 2 * rng.random()) if call <= 12 else base
    clock = FakeClock(durations)
    result = probe.compare(pairs(clock, 2), clock=clock, budget_s=1000)
    assert result.ratio == pytest.approx(2.0) and len(result.rounds) > 2


def test_a_machine_noisy_throughout_gives_no_verdict_within_the_budget():
    rng = random.Random(2)
    clock = FakeClock(lambda name, _: (1.0 if name.startswith("a") else 0.9) * math.exp(rng.gauss(0, 0.6)))
    result = probe.compare(pairs(clock, 3), clock=clock, budget_s=30.0, max_rounds=100)
    assert result.ratio is None and result.seconds > 30.0 and len(result.rounds) >= 2
    assert "no two consecutive rounds agreed" in result.describe()


def test_thread_counts_compare_their_fastest_times():
    """A neighbour busy for the first two rounds triples the every-core run's time (A: its threads wait at each
    barrier for the preempted one) and leaves the run without that core alone (B). Round by round the two busy rounds
    agree on B / A = 0.6, the wrong way round; the fastest times give the quiet machine's 1.8."""
    def durations(name, call):
        return 1.8 if name.startswith("b") else (3.0 if call <= 4 else 1.0)
    clock = FakeClock(durations)
    assert probe.compare(pairs(clock, 1), clock=clock, budget_s=100).ratio == pytest.approx(0.6)
    clock = FakeClock(durations)
    best = probe.compare(pairs(clock, 1), clock=clock, budget_s=100, estimate="best")
    assert best.ratio == pytest.approx(1.8) and best.rounds[:2] == pytest.approx((0.6, 0.6))


def test_the_thread_probe_compares_fastest_times(monkeypatch):
    seen = {}

    def fake_compare(cases, **kwargs):
        seen.update(kwargs)
        return probe.Comparison(1.5, (1.5, 1.5), 0.1)
    monkeypatch.setattr(settle, "compare", fake_compare)
    shapes = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "head_dim": 16}
    assert settle.time_fewer_over_all_threads(shapes, torch.float32, 2).ratio == 1.5
    assert seen["estimate"] == "best"


def scripted(per_case: list[float], noisy: bool = False):
    """``compare`` over fake cases whose B / A time is ``per_case[i]``; noisy: random on every call."""
    rng = random.Random(3)

    def durations(name, _):
        i = int(name[1:])
        base = per_case[i] if name.startswith("b") else 1.0
        return base * (math.exp(rng.gauss(0, 0.8)) if noisy else 1.0)

    def fake(*args, **kwargs):
        clock = FakeClock(durations)
        return probe.compare(pairs(clock, len(per_case)), clock=clock, budget_s=20.0, max_rounds=200)
    return fake


@pytest.mark.parametrize("ratios,expected", [([0.5, 0.6, 0.3], "bfloat16"),  # an AMX host, M = 1, 16, 256
                                             ([1.35, 2.5, 8.4], "float32"),  # an AVX2-only host
                                             ([0.8, 1.1, 1.3], "float32")])  # geometric mean 1.05
def test_auto_picks_the_measured_faster_dtype(monkeypatch, ratios, expected):
    monkeypatch.setattr(settle, "time_bf16_over_fp32", scripted(ratios))
    shapes = {"intermediate": 64, "hidden": 32}
    assert settle.choose_dtype(load_config(), "cpu", shapes) == expected
    assert settle.choose_dtype(load_config(dtype="bfloat16"), "cpu", shapes) == "bfloat16"
    assert settle.choose_dtype(load_config(dtype="auto"), "cuda", shapes) == "bfloat16"


@pytest.mark.parametrize("hardware_bf16,expected", [(True, "bfloat16"), (False, "float32")])
def test_too_noisy_to_tell_falls_back_to_the_hardware_answer(monkeypatch, caplog, hardware_bf16, expected):
    monkeypatch.setattr(settle, "time_bf16_over_fp32", scripted([0.5, 0.5, 0.5], noisy=True))
    monkeypatch.setattr(settle, "hardware_prefers_bf16", lambda: hardware_bf16)
    with caplog.at_level("WARNING", logger="tokenmill.engine.settle"):
        assert settle.choose_dtype(load_config(), "cpu", {"intermediate": 64, "hidden": 32}) == expected
    assert "too noisy to tell" in caplog.text and "rounds" in caplog.text


SMALL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position=128,
                    tie_word_embeddings=False, attention_bias=False, rope={"rope_type": "default", "rope_theta": 1e4})


@pytest.mark.parametrize("fewer_over_all,expected", [([1.02, 0.95], 1), ([0.94, 1.25], 2), ([1.6, 1.9], 2)])
def test_one_core_is_left_to_the_api_only_where_the_engine_loses_nothing(monkeypatch, fewer_over_all, expected):
    monkeypatch.delenv("TOKENMILL_NUM_THREADS", raising=False)  # the tests' default
    monkeypatch.setattr(settle, "time_fewer_over_all_threads", scripted(fewer_over_all))
    monkeypatch.setattr(settle, "available_cores", lambda: 2)
    auto = load_config(num_threads=None)
    assert settle.choose_threads(auto, "cpu", 1, SMALL, "float32") == expected
    monkeypatch.setattr(settle, "available_cores", lambda: 1)
    assert settle.choose_threads(auto, "cpu", 1, SMALL, "float32") == 1
    assert settle.choose_threads(load_config(num_threads=3), "cpu", 1, SMALL, "float32") == 3


def test_too_noisy_for_threads_takes_every_core(monkeypatch):
    monkeypatch.delenv("TOKENMILL_NUM_THREADS", raising=False)
    monkeypatch.setattr(settle, "time_fewer_over_all_threads", scripted([0.9, 0.9], noisy=True))
    monkeypatch.setattr(settle, "available_cores", lambda: 4)
    assert settle.choose_threads(load_config(num_threads=None), "cpu", 1, SMALL, "float32") == 4
    assert settle.choose_threads(load_config(num_threads=None), "cpu", 2, SMALL, "float32") == 2  # ranks share
    assert settle.choose_threads(load_config(num_threads=None), "cuda", 1, SMALL, "float32") is None


def test_the_measurements_time_the_real_work():
    dtypes = settle.time_bf16_over_fp32(64, 32, rows=(1, 8), budget_s=0.5)
    assert dtypes.rounds and all(r > 0 for r in dtypes.rounds)
    threads = torch.get_num_threads()
    layouts = settle.time_fewer_over_all_threads(settle.proxy_shapes(SMALL), torch.float32, 2, budget_s=0.5)
    assert layouts.rounds and all(r > 0 for r in layouts.rounds)
    assert torch.get_num_threads() == threads  # restored


def test_the_decode_proxy_has_the_models_widths():
    shapes = settle.proxy_shapes(SMALL)
    assert shapes == {"hidden": 32, "intermediate": 64, "heads": 4, "kv_heads": 2, "head_dim": 8}
    out = settle.decode_layer_proxy(shapes, torch.float32, batch=3)()
    assert out.shape == (3, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize("eager,device,backend,expected", [
    (False, "cpu", "torch", "compiled"), (True, "cpu", "torch", "eager"), (False, "cuda", "triton", "cuda_graphs"),
    (False, "cuda", "torch", "eager"), (True, "cuda", "triton", "eager")])
def test_execution_is_decided_once(eager, device, backend, expected):
    config = load_config(enforce_eager=eager)
    assert settle.choose_execution(config, device, backend, 1, SMALL) == expected
    assert settle.choose_execution(config, device, backend, 2, SMALL) == "eager"  # tensor-parallel ranks


def test_settled_is_frozen_and_names_every_choice(monkeypatch):
    monkeypatch.setattr(settle, "available_cores", lambda: 2)
    config = load_config(dtype="float32", num_threads=1, device="cpu", cpu_weight_layout="packed",
                         attention_prefetch="l2")
    settled = settle.settle(config, SMALL)
    h, d = SMALL.hidden_size, SMALL.head_dim
    shapes = {((SMALL.num_heads + 2 * SMALL.num_kv_heads) * d, h), (h, SMALL.num_heads * d),
              (2 * SMALL.intermediate_size, h), (h, SMALL.intermediate_size), (SMALL.vocab_size, h)}
    assert settled == settle.Settled(device="cpu", dtype="float32", num_threads=1, kv_cache_dtype="bf16",
                                     kernel_backend="cpu", execution="eager", speculative_method="off",
                                     tensor_parallel_size=1,  # TOKENMILL_ENFORCE_EAGER is set for the tests
                                     linear_layouts=tuple((out, inp, 1) for out, inp in sorted(shapes)),
                                     attention_prefetch="l2")
    with pytest.raises(AttributeError):
        settled.dtype = "bfloat16"
    assert settle.Settled(**settled.to_dict()) == settled  # what rank 0 broadcasts to its ranks
    with pytest.raises(Exception, match="num_nextn_predict_layers"):
        settle.settle(load_config(dtype="float32", speculative_method="mtp"), SMALL)


