import numpy as np
import pytest

from tokenmill.bench.stats import RequestResult, cost_per_million, percentile, summarize


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=101).tolist()
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None


def test_tpot_ttft_itl_definitions():
    r = RequestResult(start=10.0, end=11.5, ok=True, prompt_tokens=5, output_tokens=4,
                      chunk_times=[10.2, 10.5, 10.9, 11.4])
    assert r.ttft == pytest.approx(0.2)
    assert r.tpot == pytest.approx((11.4 - 10.2) / 3)  # (last - first) / (n - 1)
    assert r.itls == pytest.approx([0.3, 0.4, 0.5])
    assert r.e2e == pytest.approx(1.5)


def test_cost_formula():
    # $3.60 an hour at 1,000 tok/s: 3.6M tokens an hour -> $1 per million.
    assert cost_per_million(3.6, 1000.0) == pytest.approx(1.0)
    assert cost_per_million(3.6, 0.0) is None


def test_summary_counts_and_errors():
    results = [RequestResult(0.0, 2.0, True, 10, 20, [0.5, 1.0, 2.0]),
               RequestResult(1.0, 4.0, True, 10, 40, [1.5, 4.0]),
               RequestResult(1.0, 1.1, False, error="HTTP 429")]
    s = summarize(results, hourly_cost=3.6)
    assert s["completed"] == 2 and s["errors"] == {"HTTP 429": 1}
    assert s["duration_s"] == 4.0 and s["output_tok_per_s"] == 15.0 and s["total_tok_per_s"] == 20.0
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["usd_per_million_output_tokens"] == pytest.approx(3.6 / (15 * 3600) * 1e6)


def test_benchmark_table_of_the_config_file_and_flag_precedence(tmp_path):
    import argparse

    import pytest as _pytest

    from tokenmill.bench.sweep import _settings

    toml = tmp_path / "tokenmill.toml"
    toml.write_text('kv_cache_dtype = "fp8"\n[benchmark]\nmodel = "m"\nconcurrency = "2,4"\noutput_len = 7\n')
    args = argparse.Namespace(config=str(toml), output_len=9, **{k: None for k in ("model", "concurrency")})
    settings = _settings(args)
    assert settings["concurrency"] == "2,4" and settings["model"] == "m"  # from [benchmark]
    assert settings["output_len"] == 9  # the flag wins
    toml.write_text('[benchmark]\nmodel = "m"\nconcurency = "1"\n')
    with _pytest.raises(SystemExit, match="concurency"):
        _settings(argparse.Namespace(config=str(toml)))
