"""A tiny sweep against a live tokenmill server: the bench's counts agree with the server's own /metrics."""

import json

from tokenmill.bench.report import markdown_table, write_plots
from tokenmill.bench.sweep import DEFAULTS, compare, run_sweep
from tests.live_server import API_KEY, MODEL


def test_tiny_sweep_agrees_with_server_metrics(fp32_server, tmp_path):
    settings = {**DEFAULTS, "base_url": fp32_server.base_url, "model": MODEL, "api_key": API_KEY,
                "concurrency": "1,3", "input_len": 24, "output_len": 6, "num_prompts": 3, "warmup": 1, "seed": 1,
                "hourly_cost": 2.0, "vocab_size": 49152}
    report = run_sweep(settings)
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert level["completed"] == 3 and level["errors"] == {}
        assert level["usage_reported"]
        assert level["output_tokens"] == 3 * 6  # exactly output_len each (ignore_eos)
        assert level["prompt_tokens"] == 3 * 24  # exact-length token-id prompts
        assert level["server"]["generation_tokens"] == level["output_tokens"]  # the server counted the same
        assert level["ttft_s"]["p50"] > 0 and level["tpot_s"]["p50"] > 0
        expected_cost = 2.0 / (level["output_tok_per_s"] * 3600) * 1e6
        assert abs(level["usd_per_million_output_tokens"] - expected_cost) < 1e-9
        assert level["server"]["process_peak_memory_bytes"] > 100e6  # the model alone is larger
    notes = write_plots(report, tmp_path)
    assert (tmp_path / "throughput.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "latency.png").exists()
    assert "plots written" in notes[0]
    before, after = tmp_path / "a.json", tmp_path / "b.json"
    before.write_text(json.dumps(report))
    faster = json.loads(json.dumps(report))
    faster["levels"][0]["output_tok_per_s"] *= 2
    after.write_text(json.dumps(faster))
    assert "| 3 |" in markdown_table(report)
    table = compare(str(before), str(after))
    assert "| 1 | output_tok_per_s |" in table and "+100.0%" in table
