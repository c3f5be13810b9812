"""The engine collector's counters, parsed back by prometheus_client's own parser from a stub client's stats."""

from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.messages import EngineStats
from tokenmill.server.admission import Admission
from tokenmill.server.metrics import Metrics


def scrape(stats: EngineStats, weight_bytes: int = 0) -> dict[tuple, float]:
    client = SimpleNamespace(stats=stats, engine_in_own_process=False, info=SimpleNamespace(
        weight_bytes=weight_bytes, kv_block_size=16, kv_capacity_tokens=16 * 40))
    metrics = Metrics()
    metrics.add_model("m", lambda: (client, Admission(100)))
    text = generate_latest(metrics.registry).decode()
    return {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def test_prefix_and_speculative_counters():
    stats = EngineStats(prefix_cache_queries_total=120, prefix_cache_hits_total=96, spec_num_draft_tokens_total=9,
                        spec_num_accepted_tokens_total=5, spec_drafted_by_position=[4, 3, 2],
                        spec_accepted_by_position=[3, 1, 1])
    values = scrape(stats)
    assert values[("tokenmill:prefix_cache_queries_total", None)] == 120
    assert values[("tokenmill:prefix_cache_hits_total", None)] == 96
    assert values[("tokenmill:spec_decode_num_draft_tokens_total", None)] == 9
    assert values[("tokenmill:spec_decode_num_accepted_tokens_total", None)] == 5
    assert [values[("tokenmill:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(3)] == [3, 1, 1]
    assert [values[("tokenmill:spec_decode_num_draft_tokens_per_pos_total", str(p))] for p in range(3)] == [4, 3, 2]


def test_speculative_counters_are_zero_before_drafting():
    values = scrape(EngineStats())
    assert values[("tokenmill:spec_decode_num_draft_tokens_total", None)] == 0
    assert not any(name.endswith("_per_pos_total") for name, _ in values)  # no position drafted yet


def test_weight_bytes_gauge_reads_the_engine_info():
    assert scrape(EngineStats(), weight_bytes=123_456)[("tokenmill:model_weight_bytes", None)] == 123_456
