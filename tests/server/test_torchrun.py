"""A multi-node launch on one machine: torchrun starts `tokenmill serve` twice (RANK 0 and 1, MASTER_ADDR/PORT); rank
0 serves the API and rank 1 joins it over the port after torchrun's. The model is a tiny DeepSeek-V3 (MLA heads and
routed experts split over the two ranks); the served greedy answer equals one rank's."""

import signal
import subprocess
import sys

import httpx

from tests.live_server import free_port, free_port_pair, wait_ready
from tests.tiny_checkpoints import make_deepseek_checkpoint
from tokenmill import LLM, SamplingParams


def test_torchrun_launch_serves_deepseek_on_two_ranks(tmp_path, smollm_llm):
    make_deepseek_checkpoint(tmp_path, smollm_llm, "v3-q-lora")
    prompt, max_tokens = [100, 101, 102, 103, 104], 12
    one = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB")
    want = one.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].text

    port = free_port()
    master_port = free_port_pair(avoid=(port,))
    log = open(tmp_path / "torchrun.log", "w")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(master_port), "-m", "tokenmill", "serve", str(tmp_path),
           "--port", str(port), "--dtype", "float32", "--kv-cache-dtype", "fp32", "--kv-cache-memory", "8MiB",
           "--num-threads", "1"]
    launch = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", launch, 120, (tmp_path / "torchrun.log").read_text)
        body = {"model": tmp_path.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want
        assert "rank 1 of 2: joining rank 0" in (tmp_path / "torchrun.log").read_text()
    finally:
        launch.send_signal(signal.SIGINT)
        try:
            launch.wait(30)
        except subprocess.TimeoutExpired:
            launch.kill()
            launch.wait()
