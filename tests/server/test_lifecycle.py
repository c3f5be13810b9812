"""Admission control under a burst, graceful drain on a real SIGTERM, readiness while loading."""

import asyncio
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.live_server import FP32, MODEL, free_port, start_server, stop_server


def test_burst_gets_429_with_retry_after(tmp_path):
    # 128 tokens of KV and no overcommit: two requests promising ~56 tokens each fit, a third does not.
    server = start_server(tmp_path, *FP32, "--kv-cache-memory", str((128 + 16) * 46080), "--max-model-len", "128",
                          "--admission-overcommit", "1.0")
    try:
        body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 50, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*[client.post(server.base_url + "/completions", json=body)
                                              for _ in range(6)])
        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert codes == [200, 200, 429, 429, 429, 429], codes
        refused = next(r for r in responses if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"

        # The SDK maps it to its own exception class.
        long = {**body, "max_tokens": 75}
        holder = threading.Thread(target=lambda: httpx.post(server.base_url + "/completions", json=long, timeout=120))
        holder.start()
        time.sleep(1.0)
        sdk = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            sdk.completions.create(model=MODEL, prompt="x", max_tokens=75)
        holder.join()
        metrics = server.metrics_text()
        assert 'tokenmill:requests_rejected_total{model_name="SmolLM2-135M-Instruct",reason="admission"} 5.0' in metrics
        assert "tokenmill:admission_saturation" in metrics
    finally:
        stop_server(server)


def test_sigterm_drains_then_exits_zero(tmp_path):
    server = start_server(tmp_path, "--shutdown-timeout", "60")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "stream": True}
    lines: list[str] = []

    def stream():
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as r:
            lines.extend(r.iter_lines())

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while 'tokenmill:num_requests_running{model_name="SmolLM2-135M-Instruct"} 1.0' not in server.metrics_text():
        assert time.monotonic() < deadline, "the streaming request never started"
        time.sleep(0.1)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    ready = httpx.get(server.root + "/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    refused = httpx.post(server.base_url + "/completions", json={**body, "stream": False})
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    reader.join(60)
    assert server.process.wait(30) == 0
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in data[-2]  # the in-flight request ran to its end


def test_ready_is_503_while_loading_and_health_is_live(tmp_path):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, models_seen = [], []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                break
            assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            # The model may finish loading between the two calls: record, judge at the end.
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models")
            models_seen.append((models.status_code, models.json().get("error", {}).get("message", "")))
            time.sleep(0.2)
        assert (503, "loading") in seen and seen[-1] == (200, "ready")
        assert any(code == 503 and "loading" in message for code, message in models_seen)
        assert all(code in (200, 503) for code, _ in models_seen)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
