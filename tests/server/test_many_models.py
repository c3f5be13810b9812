"""Two models behind one endpoint, live: the embedded SmolLM2 and a tiny random Llama from one TOML file, each an
engine process of its own (and the tiny one again, loaded on demand). Each answers under its name and alias (SmolLM2 with the tokens tokenmill's own LLM gives,
the tiny one with transformers' greedy tokens), /v1/models lists both and the route, a route falls back from the
saturated tiny model to SmolLM2, and killing the tiny model's engine leaves SmolLM2 serving every request while the
tiny one is restarted and serves again."""

import os
import re
import signal
import threading
import time

import httpx
import openai
import torch

from tests.live_server import start_server, stop_server
from tests.tiny_checkpoints import make_llama_checkpoint

TOML = """
idle_unload_s = 2

[[models]]
name = "smol"
aliases = ["smol-alias"]
dtype = "float32"
kv_cache_dtype = "fp32"
kv_cache_memory = "256MiB"

[[models]]
name = "tiny"
model = "{path}"
aliases = ["tiny-alias"]
dtype = "float32"
kv_cache_dtype = "fp32"
kv_cache_memory = "1MiB"
max_model_len = 256
admission_overcommit = 0.125   # 256 promised tokens: one long request saturates it

[[models]]
name = "tiny-on-demand"
model = "{path}"
dtype = "float32"
kv_cache_memory = "1MiB"
max_model_len = 256
load = "on_demand"

[[routes]]
name = "auto"
default = "tiny"
fallbacks = ["smol"]
"""


def test_two_models_one_endpoint(tmp_path, smollm_llm, monkeypatch):
    from tokenmill import SamplingParams

    # The fleet shares the cores out among its engines only where no thread count is set (server/fleet_plan.py);
    # tests/conftest.py sets one for every server, under which two busy engines would fight over both cores.
    monkeypatch.delenv("TOKENMILL_NUM_THREADS")

    tiny = make_llama_checkpoint(tmp_path / "tiny", smollm_llm)
    (tmp_path / "models.toml").write_text(TOML.format(path=tmp_path / "tiny"))
    server = start_server(tmp_path, "--config", str(tmp_path / "models.toml"), ready_timeout=240)
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    try:
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"smol", "smol-alias", "tiny", "tiny-alias", "tiny-on-demand", "auto"}
        assert listed["tiny"].max_model_len == 256 and listed["tiny-alias"].root == "tiny"

        prompt = "The capital of France is"
        want = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].text
        ids = smollm_llm.tokenizer.hf(prompt)["input_ids"]
        with torch.no_grad():
            greedy = tiny.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        for model_id, name in (("smol", "smol"), ("smol-alias", "smol"), ("tiny", "tiny"), ("tiny-alias", "tiny")):
            answer = client.completions.create(model=model_id, prompt=ids if name == "tiny" else prompt,
                                               max_tokens=8, temperature=0)
            assert answer.model == name
            if name == "smol":
                assert answer.choices[0].text == want
            else:
                assert answer.choices[0].text == smollm_llm.tokenizer.hf.decode(greedy)
        for model_id in ("smol", "tiny-alias"):
            assert httpx.get(server.root + "/ready", params={"model": model_id}).status_code == 200
        assert httpx.get(server.root + "/ready", params={"model": "nope"}).status_code == 404

        _on_demand_model_loads_at_first_use_and_unloads_when_idle(server, client)
        _route_falls_back_when_tiny_is_saturated(server, client)
        _killed_engine_restarts_while_the_other_serves(server, client)
        server.process.send_signal(signal.SIGTERM)  # drains, then stops every engine
        assert server.process.wait(60) == 0, server.log()
        for pid in re.findall(r"engine process started for \S+ \(pid (\d+)\)", server.log()):
            deadline = time.monotonic() + 10
            while _alive(pid):
                assert time.monotonic() < deadline, f"engine process {pid} outlived the server"
                time.sleep(0.1)
    finally:
        stop_server(server)


def _alive(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "zombie" not in fh.read().lower()
    except FileNotFoundError:
        return False


def _on_demand_model_loads_at_first_use_and_unloads_when_idle(server, client):
    def status():
        response = httpx.get(server.root + "/ready", params={"model": "tiny-on-demand"})
        return response.status_code, response.json()["status"]
    assert status() == (503, "unloaded")
    assert client.completions.create(model="tiny-on-demand", prompt="Hi", max_tokens=4).model == "tiny-on-demand"
    assert status() == (200, "ready")
    deadline = time.monotonic() + 30
    while status() != (503, "unloaded"):  # idle_unload_s = 2
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)


def _route_falls_back_when_tiny_is_saturated(server, client):
    first_token = threading.Event()

    def hold_tiny():
        with httpx.stream("POST", server.base_url + "/completions", timeout=120, json={
                "model": "tiny", "prompt": "Once", "max_tokens": 240, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_token.set()
    holder = threading.Thread(target=hold_tiny)
    holder.start()
    assert first_token.wait(60)
    routed = client.completions.create(model="auto", prompt="Hello", max_tokens=32, temperature=0)
    holder.join(120)
    assert routed.model == "smol", "tiny was saturated: the route's fallback answers"
    quiet = client.completions.create(model="auto", prompt="Hello", max_tokens=4)
    assert quiet.model == "tiny"
    rejected = re.search(r'tokenmill:requests_rejected_total\{model_name="tiny",reason="admission"\} (\S+)',
                         server.metrics_text())
    assert rejected and float(rejected.group(1)) >= 1


def _killed_engine_restarts_while_the_other_serves(server, client):
    pid = int(re.search(r"engine process started for tiny \(pid (\d+)\)", server.log()).group(1))
    results, stop = [], threading.Event()

    def keep_asking_smol():
        while not stop.is_set():
            try:
                results.append(client.completions.create(model="smol", prompt="Hi", max_tokens=4).model)
            except Exception as exc:  # noqa: BLE001 - a failed request shows in the assertion below
                results.append(repr(exc))
    asker = threading.Thread(target=keep_asking_smol)
    asker.start()
    try:
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(server.root + "/ready", params={"model": "tiny"}).status_code == 200:
            assert time.monotonic() < deadline, "the dead engine was not noticed"
            time.sleep(0.05)
        health = httpx.get(server.root + "/health").json()
        assert health["status"] == "ok" and health["models"]["smol"] == "ready"
        deadline = time.monotonic() + 120
        while httpx.get(server.root + "/ready", params={"model": "tiny"}).status_code != 200:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
    finally:
        stop.set()
        asker.join(60)
    assert len(results) >= 3 and set(results) == {"smol"}  # every request answered, none failed
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=4).model == "tiny"
    assert 'tokenmill:engine_restarts_total{model_name="tiny"} 1.0' in server.metrics_text()
    assert len(re.findall(r"engine process started for tiny \(pid", server.log())) == 2
