"""The whole engine on the Triton kernels (through Triton's interpreter on CPU) for a tiny dense GQA model and a
tiny DeepSeek-V3 (MLA + MoE), over a paged fp8 KV cache with 4-token blocks and an 8-token step budget (so
prompts are prefilled in chunks and chunks share steps with other requests' decodes): greedy tokens equal the
PyTorch references' (``kernel_backend="torch"``), in the engine and served with ``--kernel-backend triton``.

Batches are compared under identical scheduling: batching changes float32 rounding (GEMM shapes), and a random
tiny DeepSeek's router turns such 1e-7 differences into different experts now and then, so a served batch whose
composition depends on arrival times is not a fair comparison; served requests are sent one at a time."""

import json

import pytest
import torch

from tests.helpers import kl_per_position, teacher_forced_logits
from tests.kernels.triton_device import DEVICE
from tests.live_server import start_server, stop_server
from tests.tiny_checkpoints import make_deepseek_checkpoint, make_tiny_checkpoint, write_fp8_copies
from tokenmill import LLM, SamplingParams
from tokenmill.kvcache.cache import KVCache

PROMPTS = [[(7 * i + 3 * n) % 1000 + 10 for i in range(n)] for n in (1, 5, 16, 23)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# No prefix caching: with an fp8 cache a prefix hit reads the prefix quantized where a fresh prefill uses it as
# computed (tests/engine/test_prefix_caching.py), and the reference engine here has seen every prompt before.
ENGINE = dict(dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="8MiB", max_model_len=256,
              max_num_batched_tokens=8, block_size=4, device=DEVICE.type, enable_prefix_caching=False)


@pytest.fixture(scope="module", params=["dense-gqa", "deepseek-v3"])
def tiny_model(request, tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(path, smollm_llm, "v3-q-lora" if request.param == "deepseek-v3" else request.param)
    return path, LLM(model=str(path), kernel_backend="torch", **ENGINE)


def count_triton_calls(monkeypatch) -> dict[str, int]:
    """Count the calls into each Triton entry point (the dispatch imports them from their modules at call time)."""
    import tokenmill.kernels.triton.fused_moe as moe
    import tokenmill.kernels.triton.kv_write as kv_write
    import tokenmill.kernels.triton.mla as mla
    import tokenmill.kernels.triton.paged_attention as attention

    calls: dict[str, int] = {}
    for module, name in ((kv_write, "write_kv_triton"), (attention, "paged_attention_triton"),
                         (mla, "mla_decode_triton"), (moe, "fused_moe_triton")):
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


def test_engine_batch_on_triton_matches_torch(tiny_model, monkeypatch):
    path, reference = tiny_model
    want = [r.token_ids for r in reference.generate(PROMPTS, GREEDY)]
    calls = count_triton_calls(monkeypatch)
    triton_llm = LLM(model=str(path), kernel_backend="triton", **ENGINE)
    got = [r.token_ids for r in triton_llm.generate(PROMPTS, GREEDY)]
    assert got == want
    expected = {"write_kv_triton"} | ({"mla_decode_triton", "fused_moe_triton"} if "deepseek" in path.name
                                      else {"paged_attention_triton"})
    assert set(calls) == expected  # every layer kind really ran its Triton kernel


@pytest.mark.parametrize("tiny_model", ["dense-gqa"], indirect=True)  # the flag's plumbing; the kernels: above
def test_served_on_triton_matches_torch(tmp_path, tiny_model):
    import openai

    path, reference = tiny_model
    flags = [f"--{k.replace('_', '-')}={v}" if not isinstance(v, bool) else f"--{'' if v else 'no-'}"
             f"{k.replace('_', '-')}" for k, v in ENGINE.items()]
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


def test_backend_choice_where_triton_cannot_run_is_a_clear_error_or_the_references(monkeypatch):
    import tokenmill.kernels.backend as backend
    import tokenmill.kernels.triton.common as common
    from tokenmill.kernels.backend import resolve_kernel_backend

    monkeypatch.setattr(common, "interpreting", lambda kernel: False)  # as without TRITON_INTERPRET
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_kernel_backend("triton", torch.device("cpu"))
    monkeypatch.setattr(backend, "_cpu_kernels_build", lambda: False)  # and no C compiler for the CPU kernels
    assert resolve_kernel_backend("auto", torch.device("cpu")) == "torch"
    # An A100 (8.0) has no fp8 in Triton: fp8 caches/weights fall back to the references under auto.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda", 0)
    assert resolve_kernel_backend("auto", cuda, fp8=True) == "torch"
    assert resolve_kernel_backend("auto", cuda, fp8=False) == "triton"
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        resolve_kernel_backend("triton", cuda, fp8=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kernel_backend("auto", cuda, fp8=True) == "triton"


def test_fp8_checkpoint_runs_fp8_experts_on_triton(tmp_path, smollm_llm):
    """An fp8 block-quantized DeepSeek-V3 keeps its routed experts in fp8 on the Triton backend (w8a8 fused MoE,
    activations quantized per 16-feature group) and stays close to transformers on the dequantized weights."""
    import transformers

    src = tmp_path / "bf16"
    make_deepseek_checkpoint(src, smollm_llm, "v3-q-lora")
    fp8_dir, deq_dir = write_fp8_copies(src, tmp_path, smollm_llm.tokenizer.hf, block=16)
    llm = LLM(model=str(fp8_dir), kernel_backend="triton", **{**ENGINE, "kv_cache_dtype": "fp32"})
    model = llm.engine.runner.model
    moe = model.layers[1].mlp
    assert moe.w_gate_up.dtype == moe.w_down.dtype == torch.float8_e4m3fn and moe.fp8_block == (16, 16)
    assert moe.w_gate_up_scale.dtype == torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = teacher_forced_logits(model, KVCache(model.kv_cache_spec("fp32", 4), 16, DEVICE), ids, chunk=7)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    kl = kl_per_position(ref.log_softmax(-1), ours.cpu().log_softmax(-1))
    print(f"fp8 experts (w8a8) vs dequantized weights: mean KL {kl.mean():.2e}, max {kl.max():.2e}")
    assert kl.mean() < 1e-3 and not torch.equal(ours.cpu(), ref)  # close, and really a different (fp8) path


def test_autotune_mode_measures_moe_configs_once_and_keeps_them(tmp_path, smollm_llm):
    path = tmp_path / "v3"
    make_deepseek_checkpoint(path, smollm_llm, "v3-q-lora")
    tuned = tmp_path / "tuned"
    options = dict(ENGINE, kernel_backend="triton", kernel_tuning="autotune", kernel_cache_dir=str(tuned))
    first = LLM(model=str(path), **options).generate(PROMPTS[:2], GREEDY)
    table_file = next(tuned.glob("fused_moe-*.json"))
    table = json.loads(table_file.read_text())
    assert table and all(key.startswith("E=8,I=32,H=64,k=2,") for key in table)
    stamp = table_file.stat().st_mtime_ns
    again = LLM(model=str(path), **options).generate(PROMPTS[:2], GREEDY)  # a new engine: read, not measured
    assert table_file.stat().st_mtime_ns == stamp and json.loads(table_file.read_text()) == table
    assert [r.token_ids for r in again] == [r.token_ids for r in first]


def test_qwen3_moe_experts_on_triton_match_torch(tmp_path, smollm_llm, monkeypatch):
    """Qwen3-MoE's softmax top-k routing feeds the Triton fused-MoE kernel (interpreted): the same greedy tokens."""
    from tests.family_checkpoints import make_family_checkpoint

    make_family_checkpoint(tmp_path, smollm_llm.tokenizer.hf, "qwen3-moe")
    prompts, greedy = PROMPTS[1:3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)  # interpreted: slow
    want = [r.token_ids for r in LLM(model=str(tmp_path), kernel_backend="torch", **ENGINE).generate(prompts, greedy)]
    calls = count_triton_calls(monkeypatch)
    got = [r.token_ids for r in LLM(model=str(tmp_path), kernel_backend="triton", **ENGINE).generate(prompts, greedy)]
    assert got == want
    assert {"fused_moe_triton", "paged_attention_triton", "write_kv_triton"} <= set(calls)
