"""What one request or one failure must not do to a server: a pathological grammar stalling everyone (it is refused
with a 400 naming its field while a normal stream goes on), an engine process outliving its API process (SIGKILL, a
drain that timed out), a server that cannot load its model lingering instead of exiting non-zero."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.live_server import FP32, MODEL, free_port, start_server, stop_server

# Valid, compiles in milliseconds, and then blows up: xgrammar's matcher slows down with every "a" it accepts, and its
# jump-forward search from the start runs for minutes (shared/issue 23's trial).
PATHOLOGICAL = "(a+)+" * 200


def engine_pid(server) -> int:
    match = re.search(r"engine process started for .* \(pid (\d+)\)", server.log())
    assert match, server.log()
    return int(match.group(1))


def gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "\nState:\tZ" in fh.read()
    except FileNotFoundError:
        return True


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


def stream_in_background(server, body: dict) -> tuple[threading.Thread, list[float], list[str]]:
    """Stream ``body`` on a thread; returns it with the arrival time and payload of each data line."""
    times, lines = [], []

    def run():
        try:
            with httpx.stream("POST", server.base_url + "/completions", json={**body, "stream": True},
                              timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        times.append(time.monotonic())
                        lines.append(line.removeprefix("data: "))
        except httpx.HTTPError:  # the server was killed under it: what the test does
            lines.append("<cut>")
    thread = threading.Thread(target=run)
    thread.start()
    return thread, times, lines


def test_a_pathological_regex_is_refused_while_a_normal_stream_runs(tmp_path):
    server = start_server(tmp_path, *FP32, "--grammar-timeout", "2")
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "temperature": 0}
        thread, times, lines = stream_in_background(server, body)
        deadline = time.monotonic() + 60
        while len(times) < 3:
            assert time.monotonic() < deadline, "the normal stream never started"
            time.sleep(0.02)
        bad = {"model": MODEL, "messages": [{"role": "user", "content": "Say a"}], "max_tokens": 32,
               "structured_outputs": {"regex": PATHOLOGICAL}}
        for stream in (False, True):
            start = time.monotonic()
            r = httpx.post(server.base_url + "/chat/completions", json={**bad, "stream": stream}, timeout=120)
            assert r.status_code == 400, r.text  # a stream too: refused before its first byte
            error = r.json()["error"]
            assert error["param"] == "structured_outputs.regex" and "grammar_timeout" in error["message"]
            assert time.monotonic() - start < 30  # the budget (2 s), not the minutes the grammar would take
        thread.join(120)
        assert not thread.is_alive()
        chunks = [json.loads(x) for x in lines[:-1]]
        assert lines[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert max(b - a for a, b in zip(times, times[1:])) < 5.0  # never stalled (a step takes ~0.05 s)
        # The engine never saw the grammar; the same text without the blow-up is served as usual.
        ok = httpx.post(server.base_url + "/chat/completions", timeout=120,
                        json={**bad, "structured_outputs": {"regex": "(a+)+"}, "max_tokens": 8}).json()
        assert re.fullmatch("a+", ok["choices"][0]["message"]["content"])
    finally:
        stop_server(server)


def test_sigkill_of_the_api_process_leaves_no_engine_process_behind(tmp_path):
    server = start_server(tmp_path, *FP32)
    try:
        pid = engine_pid(server)
        thread, times, _ = stream_in_background(server, {"model": MODEL, "prompt": "Once upon a time",
                                                         "max_tokens": 1500, "ignore_eos": True})
        deadline = time.monotonic() + 60
        while len(times) < 3:  # the engine is mid-generation, inside its steps
            assert time.monotonic() < deadline
            time.sleep(0.02)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
        assert wait_gone(pid, 5.0), "the engine process outlived the API process"
        thread.join(30)
    finally:
        stop_server(server)


def test_a_drain_that_times_out_kills_the_engine_and_exits(tmp_path):
    server = start_server(tmp_path, *FP32, "--shutdown-timeout", "1")
    try:
        pid = engine_pid(server)
        thread, times, _ = stream_in_background(server, {"model": MODEL, "prompt": "Once upon a time",
                                                         "max_tokens": 1500, "ignore_eos": True})
        deadline = time.monotonic() + 60
        while len(times) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
        assert time.monotonic() - start < 15 and wait_gone(pid, 2.0)
        thread.join(30)
    finally:
        stop_server(server)


def test_an_unloadable_checkpoint_exits_non_zero_within_seconds(tmp_path, smollm_llm):
    """A checkpoint with a tokenizer and a config but no weights: the model fails to load, and the process exits 1
    (a supervisor sees the failure) instead of lingering with its port closed."""
    smollm_llm.tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4}))
    log = tmp_path / "serve.log"
    process = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", str(tmp_path), "--port",
                                str(free_port())], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while "model failed to load" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        failed = time.monotonic()
        assert process.wait(20) == 1, log.read_text()
        assert time.monotonic() - failed < 10
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
