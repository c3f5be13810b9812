"""A start never fails for a compile, and a start that fails says why in one line: the stage, the cause, and the
setting that avoids it (engine/start.py). Faults are injected into each stage of a tiny Llama's start; the server's
own log is read for a real multi-line failure (a checkpoint transformers refuses to read)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import re
import sys

import pytest

from tests.live_server import free_port
from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine.start import StartError

ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", num_threads=2)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp("tiny")
    make_llama_checkpoint(path, smollm_llm)
    return path


def test_a_compile_that_fails_runs_the_model_eagerly(tiny, monkeypatch, caplog):
    from tokenmill.models import compile as compile_module

    eager = LLM(model=str(tiny), enforce_eager=True, **ENGINE).generate([[5, 6, 7]], GREEDY)[0].token_ids

    def refuse(self, input_ids, positions):
        raise RuntimeError("Could not guard on data-dependent expression Eq(u0, 0)\n(a page of compiler context)")
    monkeypatch.setattr(compile_module.CompiledDecoder, "__call__", refuse)
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm = LLM(model=str(tiny), enforce_eager=False, **ENGINE)
    assert llm.engine.info.execution == "eager" and llm.engine.runner.model.compiled_decoder is None
    said = [r.getMessage() for r in caplog.records if "compiling the layer stack failed" in r.getMessage()]
    assert said == ["execution: eager, since compiling the layer stack failed (RuntimeError: Could not guard on "
                    "data-dependent expression Eq(u0, 0) / ...); --enforce-eager skips the attempt"]
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == eager


def _fail(monkeypatch, target: str, name: str, exc: BaseException) -> None:
    def broken(*args, **kwargs):
        raise exc
    monkeypatch.setattr(target + "." + name, broken)


@pytest.mark.parametrize("target,name,stage,avoid", [
    ("tokenmill.engine.settle", "choose_threads", "the start-up measurements failed", "--num-threads"),
    ("tokenmill.engine.build", "load_model_and_cache", "loading the weights and sizing the KV cache failed",
     "--quantization int4"),
    ("tokenmill.engine.warmup", "warm_up", "running the model's first steps failed", "--kernel-backend torch"),
    ("tokenmill.models.cpu_stack.CPUDecoderStack", "build", "building the layer stack in one C call failed",
     "--no-cpu-layer-stack"),
    ("tokenmill.kvcache.cache.KVCache", "populate", "populating the KV cache failed", "--kv-cache-populate lazy"),
])
def test_a_failed_stage_is_one_line_naming_the_setting_that_avoids_it(tiny, monkeypatch, target, name, stage,
                                                                      avoid):
    _fail(monkeypatch, target, name, MemoryError("could not allocate 17179869184 bytes\nat the second line"))
    with pytest.raises(StartError) as failed:
        LLM(model=str(tiny), enforce_eager=False, **ENGINE)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(stage + " (MemoryError: could not allocate 17179869184 bytes / at the second line)")
    assert avoid in message


def test_a_checkpoint_that_cannot_be_read_fails_the_server_in_one_log_line(tmp_path, smollm_llm):
    """transformers refuses the config (layer_types longer than the layers) as it loads the tokenizer, in a message
    of several lines: the server's log says it on one line, and the server exits 1."""
    from tests.family_checkpoints import make_family_checkpoint

    make_family_checkpoint(tmp_path, smollm_llm.tokenizer.hf, "qwen3")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    log = tmp_path / "serve.log"
    process = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", str(tmp_path), "--port",
                                str(free_port())], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.wait(120) == 1, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = log.read_text().splitlines()
    failed = [i for i, line in enumerate(lines) if "failed to load:" in line]
    assert failed, log.read_text()
    line = lines[failed[0]]
    assert "num_hidden_layers" in line and "layer_types" in line, line
    assert all(re.match(r"\d{4}-\d\d-\d\d ", later) for later in lines[failed[0]:]), \
        "the cause ran on past its line:\n" + "\n".join(lines[failed[0]:failed[0] + 3])
