"""Raw SSE bytes, /metrics through prometheus-client's parser, and aborts on client disconnect."""

import json
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import ALICE_KEY, API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def metric_samples(server) -> dict[str, list]:
    families = text_string_to_metric_families(server.metrics_text())
    return {f.name: f.samples for f in families}


def sample_value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_raw_sse_bytes(fp32_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", fp32_server.base_url + "/chat/completions", json=body, headers=HEADERS) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        if event.startswith(b":"):  # an SSE comment (keep-alive ping) is allowed
            continue
        assert event.startswith(b"data: ") and b"\r" not in event and b"\n" not in event
        assert json.loads(event[len(b"data: "):])["object"] == "chat.completion.chunk"


def test_errors_come_before_any_stream_byte(fp32_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 99_999}
    r = httpx.post(fp32_server.base_url + "/chat/completions", json=body, headers=HEADERS)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_metrics_parse_and_count(fp32_server):
    def alice_generated():
        samples = metric_samples(fp32_server).get("tokenmill:key_tokens", [])
        return sample_value(samples, "tokenmill:key_tokens_total", key_name="alice", kind="generation")

    alice_before = alice_generated()
    for key in (API_KEY, ALICE_KEY):
        httpx.post(fp32_server.base_url + "/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}).raise_for_status()
    samples = metric_samples(fp32_server)
    for hist in ("tokenmill:time_to_first_token_seconds", "tokenmill:inter_token_latency_seconds",
                 "tokenmill:e2e_request_latency_seconds", "tokenmill:request_queue_time_seconds"):
        assert sample_value(samples[hist], hist + "_count", model_name=MODEL) >= 2, hist
    # TTFT buckets start at 1 ms, ITL buckets at 0.5 ms.
    le = {s.labels["le"] for s in samples["tokenmill:inter_token_latency_seconds"] if "le" in s.labels}
    assert "0.0005" in le
    gen = samples["tokenmill:generation_tokens"]
    assert sample_value(gen, "tokenmill:generation_tokens_total") >= 8
    keys = samples["tokenmill:key_tokens"]
    assert alice_generated() == alice_before + 4
    assert sample_value(keys, "tokenmill:key_tokens_total", key_name="key-1", kind="prompt") > 0
    text = fp32_server.metrics_text()
    assert API_KEY not in text and ALICE_KEY not in text
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "admission_saturation"):
        assert "tokenmill:" + gauge in samples
    # Full-precision float32 weights: the planner's count of SmolLM2's parameters, four bytes each.
    from tokenmill.bench.plan import PRESETS, num_parameters

    weights = sample_value(samples["tokenmill:model_weight_bytes"], "tokenmill:model_weight_bytes", model_name=MODEL)
    assert weights == num_parameters(PRESETS["smollm2-135m"]) * 4
    # The inference gateway's cache info: the block size and the blocks requests can hold (the engine's logged token
    # capacity over the block size; the pool's null block holds none).
    blocks = int(re.search(r"engine ready: .* \((\d+) tokens", fp32_server.log()).group(1)) // 16
    (cache,) = samples["tokenmill:cache_config_info"]
    assert (cache.value, cache.labels["block_size"], cache.labels["num_gpu_blocks"]) == (1, "16", str(blocks))
    assert API_KEY not in fp32_server.log() and ALICE_KEY not in fp32_server.log()


def test_disconnect_mid_stream_aborts_and_frees_blocks(fp32_server):
    before = sample_value(metric_samples(fp32_server)["tokenmill:requests_aborted"],
                          "tokenmill:requests_aborted_total")
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", fp32_server.base_url + "/completions", json=body, headers=HEADERS) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens arrived: the request is running
        assert any(line.startswith("data: ") for line in got)
        running = metric_samples(fp32_server)["tokenmill:num_requests_running"]
        assert sample_value(running, "tokenmill:num_requests_running") == 1
    # The socket is closed; within a step or so the engine aborts and frees every block.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        samples = metric_samples(fp32_server)
        aborted = sample_value(samples["tokenmill:requests_aborted"], "tokenmill:requests_aborted_total")
        usage = sample_value(samples["tokenmill:kv_cache_usage_perc"], "tokenmill:kv_cache_usage_perc")
        if aborted == before + 1 and usage == 0.0:
            break
        time.sleep(0.1)
    assert aborted == before + 1
    assert usage == 0.0
    assert "dragon" not in fp32_server.log()  # prompts never reach the log
    assert sample_value(samples["tokenmill:num_requests_running"], "tokenmill:num_requests_running") == 0


def test_disconnect_non_stream_aborts(fp32_server):
    before = sample_value(metric_samples(fp32_server)["tokenmill:requests_aborted"],
                          "tokenmill:requests_aborted_total")
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 1500, "ignore_eos": True}
    try:
        httpx.post(fp32_server.base_url + "/completions", json=body, headers=HEADERS, timeout=1.5)
    except httpx.ReadTimeout:
        pass  # the client gives up and closes the connection
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        samples = metric_samples(fp32_server)
        if sample_value(samples["tokenmill:requests_aborted"], "tokenmill:requests_aborted_total") == before + 1:
            break
        time.sleep(0.1)
    assert sample_value(samples["tokenmill:requests_aborted"], "tokenmill:requests_aborted_total") == before + 1
    assert sample_value(samples["tokenmill:kv_cache_usage_perc"], "tokenmill:kv_cache_usage_perc") == 0.0


def test_tpot_histogram_is_the_mean_inter_token_latency_per_request(fp32_server):
    def totals():
        samples = metric_samples(fp32_server)
        return {name: (sample_value(samples[name], name + "_sum", model_name=MODEL),
                       sample_value(samples[name], name + "_count", model_name=MODEL))
                for name in ("tokenmill:time_per_output_token_seconds", "tokenmill:inter_token_latency_seconds")}

    def decode_steps():
        samples = metric_samples(fp32_server)
        return [sample_value(samples[name], name + "_total", model_name=MODEL)
                for name in ("tokenmill:engine_decode_steps", "tokenmill:engine_decode_step_seconds")]

    before, steps_before = totals(), decode_steps()
    httpx.post(fp32_server.base_url + "/completions", headers=HEADERS, json={
        "model": MODEL, "prompt": "Hello there, how are you?", "max_tokens": 12, "ignore_eos": True,
        "stream": True}).raise_for_status()
    after, steps_after = totals(), decode_steps()
    # 12 tokens: the prompt's prefill step samples the first, 11 pure decode steps the rest.
    assert steps_after[0] - steps_before[0] == 11 and steps_after[1] > steps_before[1]
    (tpot_sum, tpot_count), (itl_sum, itl_count) = (
        tuple(a - b for a, b in zip(after[name], before[name])) for name in after)
    # One request of 12 tokens: one TPOT observation = (last - first) / 11 = the mean of its 11 inter-token gaps.
    assert (tpot_count, itl_count) == (1, 11)
    assert tpot_sum == pytest.approx(itl_sum / 11, rel=1e-6)


def test_prefix_cache_hits_reach_usage_and_metrics(fp32_server):
    """A repeated long system prompt: the second request reports whole cached blocks in the OpenAI SDK's
    usage.prompt_tokens_details.cached_tokens (streamed too), and the Prometheus counters move by the same tokens;
    another cache_salt shares nothing."""
    import openai

    client = openai.OpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0)
    system = f"Session {time.time_ns()}. " + "You are a careful assistant who answers in one short sentence. " * 6

    def ask(question: str, **extra):
        return client.chat.completions.create(
            model=MODEL, max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}], **extra)

    def counters():
        samples = metric_samples(fp32_server)
        return [sample_value(samples[n], n + "_total") for n in ("tokenmill:prefix_cache_queries",
                                                                 "tokenmill:prefix_cache_hits")]

    first = list(ask("Name a colour."))[-1].usage
    assert first.prompt_tokens_details.cached_tokens == 0
    queries0, hits0 = counters()
    second = list(ask("Name a fruit."))[-1].usage
    cached = second.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.prompt_tokens
    queries1, hits1 = counters()
    assert (queries1 - queries0, hits1 - hits0) == (second.prompt_tokens, cached)
    salted = client.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0, extra_body={"cache_salt": "tenant-b"},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}])
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
