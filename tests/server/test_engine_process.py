"""The engine core runs in a child process of `tokenmill serve`; when that child dies, the API process says so:
in-flight requests end with an OpenAI-shaped error (an error event in a stream, a 500 body otherwise), /ready and
/health turn 503 (a supervisor restarts the pod), new requests get 503. (--no-engine-process, the engine on a thread
of the API process, serves the tiny DeepSeek in tests/models/test_deepseek.py.)"""

import os
import re
import signal
import threading
import time

import httpx

from tests.live_server import FP32, MODEL, start_server, stop_server


def engine_pid(server) -> int:
    match = re.search(r"engine process started \(pid (\d+)\)", server.log())
    assert match, server.log()
    return int(match.group(1))


def test_killed_engine_fails_requests_readiness_and_health(tmp_path):
    server = start_server(tmp_path, *FP32)
    long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    stream_lines: list[str] = []
    plain: list[httpx.Response] = []

    def stream():
        with httpx.stream("POST", server.base_url + "/completions", json={**long, "stream": True}, timeout=120) as r:
            stream_lines.extend(r.iter_lines())

    readers = [threading.Thread(target=stream),
               threading.Thread(target=lambda: plain.append(httpx.post(server.base_url + "/completions", json=long,
                                                                       timeout=120)))]
    try:
        pid = engine_pid(server)
        assert httpx.get(server.root + "/health").status_code == 200
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 30
        while 'num_requests_running{model_name="SmolLM2-135M-Instruct"} 2.0' not in server.metrics_text():
            assert time.monotonic() < deadline, "the two requests never ran"
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        for reader in readers:
            reader.join(30)
            assert not reader.is_alive(), "a request hung after the engine died"
        data = [line.removeprefix("data: ") for line in stream_lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and '"error"' in data[-2] and '"server_error"' in data[-2]
        assert plain[0].status_code == 500 and plain[0].json()["error"]["type"] == "server_error"
        assert httpx.get(server.root + "/ready").status_code == 503
        assert httpx.get(server.root + "/health").status_code == 503
        refused = httpx.post(server.base_url + "/completions", json={**long, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
    finally:
        stop_server(server)

