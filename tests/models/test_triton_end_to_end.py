"""The whole engine on the Triton kernels (through Triton's interpreter on CPU) for a tiny dense GQA model and a
tiny DeepSeek-V3 (MLA + MoE), over a paged fp8 KV cache with 4-token blocks and an 8-token step budget (so
prompts are prefilled in chunks and chunks share steps with other requests' decodes): greedy tokens equal the
PyTorch references' (``kernel_backend="torch"``), in the engine and served with ``--kernel-backend triton``.

Batches are compared under identical scheduling: batching changes float32 rounding (GEMM shapes), and a random
tiny DeepSeek's router turns such 1e-7 differences into different experts now and then, so a served batch whose
composition depends on arrival times is not a fair comparison; served requests are sent one at a time."""

import pytest
import torch

from tests.kernels.triton_device import DEVICE
from tests.live_server import start_server, stop_server
from tests.tiny_checkpoints import make_deepseek_checkpoint, make_llama_checkpoint
from tokenmill import LLM, SamplingParams

PROMPTS = [[(7 * i + 3 * n) % 1000 + 10 for i in range(n)] for n in (1, 5, 16, 23)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="8MiB", max_model_len=256,
              max_num_batched_tokens=8, block_size=4, device=DEVICE.type)


@pytest.fixture(scope="module", params=["dense-gqa", "deepseek-v3"])
def tiny_model(request, tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "dense-gqa":
        make_llama_checkpoint(path, smollm_llm)
    else:
        make_deepseek_checkpoint(path, smollm_llm, "v3-q-lora")
    return path, LLM(model=str(path), kernel_backend="torch", **ENGINE)


def test_engine_batch_on_triton_matches_torch(tiny_model):
    path, reference = tiny_model
    triton_llm = LLM(model=str(path), kernel_backend="triton", **ENGINE)
    got = [r.token_ids for r in triton_llm.generate(PROMPTS, GREEDY)]
    assert got == [r.token_ids for r in reference.generate(PROMPTS, GREEDY)]


def test_served_on_triton_matches_torch(tmp_path, tiny_model):
    import openai

    path, reference = tiny_model
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    server = start_server(tmp_path, *flags, "--kernel-backend", "triton", str(path))
    try:
        assert "kernel backend: triton" in server.log()
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        for prompt in PROMPTS:
            got = client.completions.create(model=path.name, prompt=prompt, max_tokens=GREEDY.max_tokens,
                                            temperature=0, extra_body={"ignore_eos": True}).choices[0].text
            assert got == reference.generate([prompt], GREEDY)[0].text
    finally:
        stop_server(server)


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_config_error(monkeypatch):
    import tokenmill.kernels.triton.common as common
    from tokenmill.kernels.backend import resolve_kernel_backend

    monkeypatch.setattr(common, "interpreting", lambda kernel: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_kernel_backend("triton", torch.device("cpu"))
    assert resolve_kernel_backend("auto", torch.device("cpu")) == "torch"
