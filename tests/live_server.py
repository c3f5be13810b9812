"""Live tokenmill servers in subprocesses on 127.0.0.1, one per configuration."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-test-key-0123456789"
ALICE_KEY = "sk-alice-9876543210"
FP32 = ["--dtype", "float32", "--kv-cache-dtype", "fp32"]
CORS_ORIGIN = "https://dashboard.example"


@dataclass
class LiveServer:
    process: subprocess.Popen
    base_url: str
    log_path: str

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def log(self) -> str:
        with open(self.log_path) as fh:
            return fh.read()

    def metrics_text(self) -> str:
        return httpx.get(self.root + "/metrics", timeout=10).text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair(avoid: tuple[int, ...] = ()) -> int:
    """A port P with P+1 also free now and neither in ``avoid`` (torchrun's rendezvous is on P, tokenmill's ranks meet
    on P+1)."""
    while True:
        port = free_port()
        if port in avoid or port + 1 in avoid:
            continue
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("0.0.0.0", port))
                second.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        return port


def start_server(tmp_path, *args: str, ready_timeout: float = 120.0) -> LiveServer:
    port = free_port()
    log_path = str(tmp_path / f"server-{port}.log")
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "--kv-cache-memory", "512MiB",
           "--max-model-len", "2048", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    server = LiveServer(process, f"http://127.0.0.1:{port}/v1", log_path)
    try:
        wait_ready(server.root, process, ready_timeout, server.log)
    except RuntimeError:
        stop_server(server)
        raise
    return server


def wait_ready(root: str, process: subprocess.Popen, timeout: float, log, headers: dict | None = None) -> None:
    """Until ``root``/ready answers 200; RuntimeError with ``log()`` if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log()}")
        try:
            if httpx.get(root + "/ready", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not ready in {timeout} s:\n{log()}")


def stop_server(server: LiveServer) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(20)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def fp32_server(tmp_path_factory):
    """fp32 compute and KV (deterministic enough to compare tokens), with API keys and their series on /metrics."""
    tmp = tmp_path_factory.mktemp("fp32")
    keys = tmp / "keys.txt"
    keys.write_text(f"# name: key\nalice: {ALICE_KEY}\n")
    server = start_server(tmp, *FP32, "--api-key", API_KEY, "--api-key-file", str(keys),
                          "--cors-origins", CORS_ORIGIN, "--metrics-per-key")
    yield server
    stop_server(server)


@contextmanager
def inprocess_server(**config):
    """A server with its engine in this process (--no-engine-process, uvicorn on a thread) for ``config``
    (load_config's keywords): yields (root URL, ServerState)."""
    import threading

    import uvicorn

    from tokenmill.config import load_config
    from tokenmill.server.app import build_app
    from tokenmill.server.launch import build_state

    engine_config = load_config(engine_process=False, **config)
    state = build_state(engine_config, lambda host, exc: None)
    app = build_app(state, engine_config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    root = f"http://127.0.0.1:{port}"

    class Alive:
        @staticmethod
        def poll():
            return None if thread.is_alive() else 1
    try:
        keys = [*engine_config.api_key, *(k.key for k in engine_config.keys if k.key)]
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else None  # /ready may want one (auth_all_endpoints)
        wait_ready(root, Alive, 120, lambda: "the in-process server did not become ready", headers)
        yield root, state
    finally:
        server.should_exit = True
        thread.join(30)
        state.fleet.stop(timeout=10)
        if state.ledger is not None:
            state.ledger.close()
