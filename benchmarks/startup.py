"""What start-up costs, piece by piece, for the default model (SmolLM2 GGUF): opening the GGUF file with gguf's own
reader over its np.memmap vs tokenmill's one-pass header reader (models/gguf_file.py), converting the GGUF tokenizer with transformers vs
reading the cached conversion, and `tokenmill serve` (eager) from launch to /ready with a warm tokenizer cache.
Alternates the variants ``--repeats`` times in one process and reports medians; writes JSON (``--out``).

    python benchmarks/startup.py --out benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill.models.gguf_file import read_gguf
from tokenmill.models.loader import default_model_path
from tokenmill.models.tokenizer import Tokenizer


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def serve_to_ready(port: int) -> float:
    env = {**os.environ, "TOKENMILL_ENFORCE_EAGER": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--out", default="benchmarks/results/startup.json")
    args = parser.parse_args()

    from gguf import GGUFReader

    gguf = default_model_path()
    cache = tempfile.mkdtemp(prefix="tokenmill-tokenizers-")
    Tokenizer(gguf.parent, gguf.name, cache)  # fills the cache
    samples: dict[str, list[float]] = {k: [] for k in ("gguf_reader_memmap_s", "read_gguf_s",
                                                      "tokenizer_convert_s", "tokenizer_cached_s",
                                                      "serve_to_ready_s")}
    for _ in range(args.repeats):
        samples["gguf_reader_memmap_s"].append(timed(lambda: GGUFReader(str(gguf))))
        samples["read_gguf_s"].append(timed(lambda: read_gguf(gguf)))
        samples["tokenizer_convert_s"].append(timed(lambda: Tokenizer(gguf.parent, gguf.name, cache_dir=None)))
        samples["tokenizer_cached_s"].append(timed(lambda: Tokenizer(gguf.parent, gguf.name, cache)))
        samples["serve_to_ready_s"].append(serve_to_ready(args.port))
    result = {"command": f"python benchmarks/startup.py {' '.join(sys.argv[1:])}", "date": time.strftime("%Y-%m-%d"),
              "cores": os.cpu_count(), "samples": samples,
              "median": {k: round(statistics.median(v), 3) for k, v in samples.items()}}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
