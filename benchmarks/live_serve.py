"""What benchmarks/hostile_inputs.py and benchmarks/soak.py share: a `tokenmill serve` of their own in a subprocess
(its log in a file, its engine's pid read from that log), /metrics as numbers, a process's RSS, the host's CPU flags.

Not a benchmark: imported by those scripts (run as ``python benchmarks/NAME.py``, which puts this folder first on
sys.path). It imports no tokenmill module, so the clients never load torch or the kernels beside the server.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
ENGINE_STARTED = re.compile(r"engine process started for .* \(pid (\d+)\)")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def cpu_flags() -> list[str]:
    """The flags every figure is named beside (DESIGN.md): avx2 / avx512f / avx512_bf16 / avx512_vnni / amx_bf16."""
    wanted = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted(wanted & set(re.findall(r"[a-z0-9_]+", text)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_pid(log_path: str | Path | None) -> int | None:
    """The pid of the last engine process the server's log says it started; None without a log or a line."""
    if log_path is None:
        return None
    try:
        found = ENGINE_STARTED.findall(Path(log_path).read_text(errors="replace"))
    except OSError:
        return None
    return int(found[-1]) if found else None


def alive(pid: int | None) -> bool:
    """The process runs (a zombie nobody reaped counts as gone); True for an unknown pid (nothing to say)."""
    if pid is None:
        return True
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def rss_bytes(pid: int | None) -> int | None:
    """VmRSS of ``pid`` in bytes; None when the process is gone or unknown."""
    if pid is None:
        return None
    try:
        match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def metrics(root: str, headers: dict | None = None) -> dict[str, float] | None:
    """/metrics as {name: value summed over label sets}; None when unreachable."""
    try:
        response = httpx.get(root + "/metrics", headers=headers or {}, timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        match = SAMPLE.match(line.strip())
        if match and not line.startswith("#"):
            try:
                values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(3))
            except ValueError:
                pass
    return values


def log_tail(log_path: str | Path | None, lines: int = 40) -> str:
    if log_path is None:
        return ""
    try:
        return "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class OwnServer:
    """`python -m tokenmill serve --port PORT *args` on 127.0.0.1 (this interpreter, this checkout first on
    PYTHONPATH as the caller set it), its output in ``log_dir``/server-N.log, N counting restarts."""

    def __init__(self, args: list[str], log_dir: Path, port: int | None = None):
        self.args, self.log_dir, self.port = list(args), Path(log_dir), port or free_port()
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.log_path: Path | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "tokenmill", "serve", "--port", str(self.port), *self.args]

    def start(self, ready_timeout: float = 600.0) -> None:
        import os
        self.log_path = self.log_dir / f"server-{self.starts}.log"
        self.starts += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{log_tail(self.log_path)}")
            try:
                if httpx.get(self.root + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready in {ready_timeout} s:\n{log_tail(self.log_path)}")

    def engine_pid(self) -> int | None:
        return engine_pid(self.log_path)

    def api_pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self) -> None:
        """SIGINT (stops at once), SIGKILL after 20 s; waits for the exit either way."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
