"""Tensor parallelism on CPU with gloo: ranks 1..N-1 are processes of their own, rank 0 is the engine core.

Greedy tokens at --tensor-parallel-size 2 equal transformers', fp32, for a tiny Llama with 2 KV heads (split) and
with 1 KV head (replicated) and a vocabulary that does not split evenly (the last shard padded), a tiny Qwen2
(sharded q/k/v biases), and tiny DeepSeek-V2 and V3 (MLA heads split, the latent replicated, 8 routed experts 4 per
rank, the shared expert split by width; V3 also with its MTP layer drafting). A killed rank fails the next step at once instead of hanging. The embedded SmolLM2 GGUF on 3
ranks (tied embeddings, slices cut after dequantizing), served through the API, is in
tests/server/test_engine_process.py.
"""

import os
import signal
import time

import pytest
import torch

from tests.conftest import hf_greedy
from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[(5 * i) % 7 + 100 for i in range(n)] for n in (9, 20, 33)]
FP32 = dict(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB", num_threads=1)

CHECKPOINTS = {
    "llama-2-kv-heads": dict(arch="llama"),
    "llama-1-kv-head-odd-vocab": dict(arch="llama", num_kv_heads=1, extra_vocab=3),
    "qwen2": dict(arch="qwen2"),
}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_two_ranks_equal_transformers(tmp_path, smollm_llm, kind):
    hf = make_llama_checkpoint(tmp_path, smollm_llm, **CHECKPOINTS[kind])
    llm = two_ranks_match(tmp_path, hf)
    c = hf.config
    local_kv = max(1, c.num_key_value_heads // 2)
    assert llm.engine.info.kv_bytes_per_token == c.num_hidden_layers * 2 * local_kv * 16 * 4  # this rank's heads
    assert llm.engine.runner.model.lm_head.weight.shape[0] == -(-c.vocab_size // 2)  # one rank's vocabulary rows


@pytest.mark.parametrize("kind", ["v2-lite-like", "v3-q-lora"])
def test_two_ranks_split_mla_heads_and_experts(tmp_path, smollm_llm, kind):
    from tests.tiny_checkpoints import make_deepseek_checkpoint

    hf = make_deepseek_checkpoint(tmp_path, smollm_llm, kind)
    llm = two_ranks_match(tmp_path, hf)
    model, c = llm.engine.runner.model, hf.config
    moe = model.layers[c.first_k_dense_replace].mlp
    assert moe.w_gate_up.shape[0] == c.n_routed_experts // 2 and moe.gate_weight.shape[0] == c.n_routed_experts
    a = c.kv_lora_rank + c.qk_rope_head_dim
    assert llm.engine.info.kv_bytes_per_token == c.num_hidden_layers * a * 4  # the whole latent on every rank


def test_two_ranks_read_fp8_blocks_with_their_scales(tmp_path, smollm_llm):
    """An fp8 copy of the tiny V3 (16 x 16 blocks): each rank reads its slices of the weights and the matching rows
    or columns of their scales; greedy tokens equal transformers' on the same weights dequantized."""
    import transformers

    from tests.tiny_checkpoints import make_deepseek_checkpoint, write_fp8_copies

    make_deepseek_checkpoint(tmp_path / "bf16", smollm_llm, "v3-q-lora")
    fp8, deq = write_fp8_copies(tmp_path / "bf16", tmp_path, smollm_llm.tokenizer.hf, block=16)
    two_ranks_match(fp8, transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval())


def test_two_ranks_with_mtp_drafts(tmp_path, smollm_llm):
    from tests.tiny_checkpoints import make_mtp_checkpoint

    hf, _ = make_mtp_checkpoint(tmp_path, smollm_llm)
    llm = two_ranks_match(tmp_path, hf, speculative_method="mtp", num_speculative_tokens=2)
    assert llm.engine.stats().spec_num_draft_tokens_total > 0


def two_ranks_match(path, hf, **config) -> LLM:
    """An LLM on 2 ranks whose greedy tokens equal transformers' (closed at the end of the test session)."""
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    llm = LLM(model=str(path), tensor_parallel_size=2, max_num_batched_tokens=24, **FP32, **config)
    try:
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected
    finally:
        llm.close()
    return llm


def test_sizes_that_do_not_split_are_config_errors():
    with pytest.raises(ConfigError, match=r"attention heads \(9\) is not divisible by the tensor-parallel size 2"):
        LLM(tensor_parallel_size=2, **FP32)


def test_a_killed_rank_fails_the_engine_instead_of_hanging(tmp_path, smollm_llm):
    make_llama_checkpoint(tmp_path, smollm_llm)
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, **FP32)
    engine = llm.engine
    try:
        llm.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        engine.step()
        worker = engine.ranks.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 5
    finally:
        llm.close()


def test_each_rank_reads_only_its_slices(tmp_path, smollm_llm):
    """The loader hands a rank its slice of each tensor (safetensors get_slice): equal to slicing the whole."""
    from tokenmill.models.loader import open_checkpoint

    make_llama_checkpoint(tmp_path, smollm_llm)
    checkpoint = open_checkpoint(str(tmp_path))
    whole = dict(checkpoint.weights())
    shard = {"model.layers.0.self_attn.o_proj.weight": (1, slice(16, 48)),
             "model.layers.1.mlp.up_proj.weight": (0, slice(48, 96))}
    for name, tensor in checkpoint.weights(shard.get):
        dim, part = shard.get(name, (0, slice(None)))
        torch.testing.assert_close(tensor, whole[name][(slice(None),) * dim + (part,)], rtol=0, atol=0)


def test_a_rank_that_cannot_load_names_itself(tmp_path, smollm_llm):
    """fp8 blocks of 128 rows cannot split 96 query rows in two: rank 1's slice starts inside a block. Rank 0's
    slice starts at 0 and loads; the engine reports rank 1's exit rather than a broken connection."""
    from tests.tiny_checkpoints import make_deepseek_checkpoint, write_fp8_copies

    make_deepseek_checkpoint(tmp_path / "bf16", smollm_llm, "v3-q-lora")
    fp8, _ = write_fp8_copies(tmp_path / "bf16", tmp_path, smollm_llm.tokenizer.hf, block=128)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 .* exited with code 1"):
        LLM(model=str(fp8), tensor_parallel_size=2, **FP32)


PEAK_PROBE = r"""
import sys, threading, time
from tokenmill.models.loader import open_checkpoint

def rss():  # resident memory, anonymous and file-backed: safetensors may hand out views of its memory map
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024

peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)

checkpoint = open_checkpoint(sys.argv[1])
shard = {"half": lambda name: (0, slice(0, 4096)), "whole": None}[sys.argv[2]]
base = rss()
threading.Thread(target=sample, daemon=True).start()
for name, tensor in checkpoint.weights(shard):
    tensor.sum()  # read, as a model's copy_ reads it (views of the file's memory map fault in only then)
    time.sleep(0.2)
    del tensor
done.set()
print(peak[0] - base)
"""


def test_a_rank_holds_only_its_slice_of_a_tensor_while_loading(tmp_path):
    """The loader's peak host memory on a sharded checkpoint: reading half the rows of a 128 MiB tensor grows the
    process by about 64 MiB (the slice, plus a few MiB), reading it whole by about 128 MiB."""
    import json
    import subprocess
    import sys

    from safetensors.torch import save_file

    save_file({"big.weight": torch.randn(8192, 4096)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    growth = {kind: int(subprocess.run([sys.executable, "-c", PEAK_PROBE, str(tmp_path), kind], check=True,
                                       capture_output=True, text=True).stdout) for kind in ("half", "whole")}
    mib = 2 ** 20
    assert growth["whole"] > 120 * mib and 60 * mib < growth["half"] < 0.6 * growth["whole"], growth
