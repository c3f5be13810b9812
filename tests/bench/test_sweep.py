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


def test_a_level_where_every_request_fails_is_an_error(fp32_server, capsys):
    """A wrong model name (404 on every request), a wrong address (nothing listening) and a wrong key exit non-zero
    with the first error's message, never a table of zeros."""
    from tests.live_server import free_port
    from tokenmill.bench.sweep import main

    common = ["--concurrency", "2", "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--warmup", "0",
              "--vocab-size", "49152"]
    assert main(["--base-url", fp32_server.base_url, "--api-key", API_KEY, "--model", "no-such-model", *common]) == 1
    err = capsys.readouterr().err
    assert "every request at concurrency 2 failed" in err and "HTTP 404" in err and "no-such-model" in err
    assert main(["--base-url", f"http://127.0.0.1:{free_port()}/v1", *common]) == 1
    assert "cannot list the models" in capsys.readouterr().err
    # a refused listing names the server's status and message (here a wrong key; a loading model's is a 503)
    assert main(["--base-url", fp32_server.base_url, "--api-key", "not-the-key", *common]) == 1
    err = capsys.readouterr().err
    assert "cannot list the models" in err and "HTTP 401" in err and "KeyError" not in err


def test_base_url_with_or_without_v1(fp32_server):
    from tokenmill.bench.loadgen import normalize_base_url

    root = fp32_server.root
    assert normalize_base_url(root) == normalize_base_url(root + "/") == normalize_base_url(root + "/v1/") \
        == fp32_server.base_url
    settings = {**DEFAULTS, "base_url": root, "model": MODEL, "api_key": API_KEY, "concurrency": "1",
                "input_len": 8, "output_len": 2, "num_prompts": 1, "warmup": 0, "seed": 1, "vocab_size": 49152}
    assert run_sweep(settings)["levels"][0]["completed"] == 1


def test_shared_prefix_dataset_reports_the_servers_prefix_hit_rate(fp32_server):
    """Prompts of 40 tokens sharing their first 32 (two blocks of 16): after the warm-up request computes the prefix,
    each measured request finds 32 of its 40 tokens cached, so the hit rate from /metrics is exactly 0.8."""
    settings = {**DEFAULTS, "base_url": fp32_server.base_url, "model": MODEL, "api_key": API_KEY,
                "concurrency": "1", "dataset": "shared-prefix", "prefix_len": 32, "input_len": 40, "output_len": 2,
                "num_prompts": 3, "warmup": 1, "seed": 11, "vocab_size": 49152}
    report = run_sweep(settings)
    level = report["levels"][0]
    assert level["completed"] == 3 and level["prompt_tokens"] == 3 * 40
    assert level["server"]["prefix_cache_hit_rate"] == 0.8
    assert "| 80% |" in markdown_table(report)


def test_shared_prefix_prompts_share_exactly_the_prefix():
    from tokenmill.bench.loadgen import shared_prefix_prompts

    prompts = shared_prefix_prompts(4, 10, 15, 49152, seed=3)
    assert all(len(p) == 15 and p[:10] == prompts[0][:10] for p in prompts)
    assert len({tuple(p[10:]) for p in prompts}) == 4


def test_copy_dataset_prompts_hold_their_passage():
    from tokenmill.bench.copy_texts import INSTRUCTIONS, PASSAGES, copy_prompts

    prompts = copy_prompts(len(INSTRUCTIONS) * len(PASSAGES) + 1)
    assert len(set(prompts)) == len(INSTRUCTIONS) * len(PASSAGES) and prompts[-1] == prompts[0]
    assert all(any(p.endswith(passage) for passage in PASSAGES) for p in prompts)
