"""Who uses the cores while tokenmill serves: CPU seconds of the API process, the engine process and the load
generator (``tokenmill bench``) over one concurrency level, read from /proc (Linux), as shares of the machine.

    python benchmarks/cpu_share.py [--concurrency 32] [--requests 128] [--out benchmarks/results/cpu-share.json]

``tokenmill serve`` starts with its defaults; one warm-up level (8 requests at a time) runs first, then the measured
level (256 prompt + 64 output tokens a request, streaming). A process's CPU time is its utime + stime (all threads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compare_cpu import wait_ready

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of the whole line)


def engine_pid(server: int) -> int:
    """The engine core: the server's child started by multiprocessing's spawn (not its resource tracker)."""
    for proc in Path("/proc").iterdir():
        try:
            parent = int(proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == server and b"spawn_main" in proc.joinpath("cmdline").read_bytes():
                return int(proc.name)
        except (OSError, ValueError, IndexError):
            continue
    raise RuntimeError("no engine process under the server (engine_process off?)")


def bench(port: int, concurrency: int, requests: int, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tokenmill", "bench", "--base-url", f"http://127.0.0.1:{port}/v1",
                             "--concurrency", str(concurrency), "--input-len", "256", "--output-len", "64",
                             "--num-prompts", str(requests), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--port", type=int, default=8140)
    parser.add_argument("--out", default="benchmarks/results/cpu-share.json")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(args.port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{args.port}/ready", server, 600)
        engine = engine_pid(server.pid)
        with tempfile.TemporaryDirectory() as work:
            bench(args.port, 8, 16, Path(work) / "warm").wait()
            api0, engine0, start = cpu_seconds(server.pid), cpu_seconds(engine), time.monotonic()
            load = bench(args.port, args.concurrency, args.requests, Path(work) / "level")
            generator = 0.0
            while load.poll() is None:  # its last reading before it exits
                try:
                    generator = cpu_seconds(load.pid)
                except (OSError, ValueError):
                    pass
                time.sleep(0.2)
            wall = time.monotonic() - start
            api, engine_s = cpu_seconds(server.pid) - api0, cpu_seconds(engine) - engine0
            level = json.loads((Path(work) / "level" / "bench.json").read_text())["levels"][0]
    finally:
        server.terminate()
        server.wait(60)
    cores = os.cpu_count() or 1
    seconds = {"engine": engine_s, "api": api, "load_generator": generator}
    result = {"command": " ".join(["python benchmarks/cpu_share.py", *sys.argv[1:]]), "cores": cores,
              "wall_seconds": wall, "cpu_seconds": seconds,
              "shares_of_the_cores": {k: v / (cores * wall) for k, v in seconds.items()},
              "errors": level["errors"], "output_tok_per_s": level["output_tok_per_s"], "level": level}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    errors = level["errors"]  # by kind
    print(f"concurrency {args.concurrency}: {level['output_tok_per_s']:.1f} output tok/s, "
          f"{sum(errors.values()) if isinstance(errors, dict) else errors} failed requests; "
          f"shares of {cores} cores over {wall:.1f} s: " +
          ", ".join(f"{k} {v:.0%}" for k, v in result["shares_of_the_cores"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
