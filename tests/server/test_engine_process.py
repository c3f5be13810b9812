"""The engine core runs in a child process of `tokenmill serve`; when that child (or a tensor-parallel rank of it)
dies, the API process says so: in-flight requests end with an OpenAI-shaped error (an error event in a stream, a 500
body otherwise), /ready and /health turn 503, new requests get 503, and a few seconds later the server exits 1 (its
supervisor starts a fresh one). (--no-engine-process, the engine on a thread
of the API process, serves the tiny DeepSeek in tests/models/test_deepseek.py.)"""

import os
import re
import signal
import threading
import time

import httpx

from tests.live_server import FP32, MODEL, start_server, stop_server


def engine_pid(server) -> int:
    match = re.search(r"engine process started for .* \(pid (\d+)\)", server.log())
    assert match, server.log()
    return int(match.group(1))


def test_killed_engine_fails_requests_readiness_and_health(tmp_path):
    server = start_server(tmp_path, *FP32)
    _kill_while_two_requests_run(server, lambda: engine_pid(server))


def test_killed_tensor_parallel_rank_fails_the_server_the_same_way(tmp_path, smollm_llm):
    """SmolLM2 on three ranks (its 9 heads split 3 ways), served: the greedy answer equals one rank's; then rank 2
    is killed."""
    from tokenmill import SamplingParams

    three = start_server(tmp_path, *FP32, "--tensor-parallel-size", "3", "--num-threads", "1")
    prompt = "The capital of France is"
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    text = httpx.post(three.base_url + "/completions", json=request, timeout=60).json()["choices"][0]["text"]
    assert text and text == smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].text

    def rank_2_pid() -> int:
        match = re.search(r"tensor parallel: 3 ranks, workers pid (\d+), (\d+)", three.log())
        assert match, three.log()
        return int(match.group(2))
    _kill_while_two_requests_run(three, rank_2_pid)


def _kill_while_two_requests_run(server, pid_to_kill):
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
        pid = pid_to_kill()
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
        assert server.process.wait(30) == 1, "the server should exit 1 for its supervisor"
    finally:
        stop_server(server)
