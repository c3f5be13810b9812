"""The CUDA-graph decode path's plumbing, proven on CPU: the static buffers, the padding rows (token 0, KV slot -1,
a one-token context in the null block) and the per-size metadata with its fixed split count, run eagerly in place of
a replay (``capture=False``), give exactly the tokens of plain eager steps -- for GQA and MLA + MoE, with the PyTorch
references and the Triton kernels (interpreter). Capture and replay themselves need a GPU:
benchmarks/gpu_check.sh runs them (CUDA-graph decode equal to eager)."""

import pytest

from tests.family_checkpoints import make_family_checkpoint
from tests.tiny_checkpoints import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes


def test_batch_sizes_climb_to_max_num_seqs():
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert graph_batch_sizes(1000)[-1] == 256


@pytest.mark.parametrize("kind,backend", [("dense-gqa", "torch"), ("v3-q-lora", "torch"), ("dense-gqa", "triton"),
                                          ("gpt-oss", "torch")])
def test_static_decode_path_equals_eager(tmp_path, smollm_llm, kind, backend):
    """gpt-oss: two KV groups (sliding window 8, full), each with its own static slots and tables."""
    if kind == "gpt-oss":
        make_family_checkpoint(tmp_path, smollm_llm.tokenizer.hf, kind)
    else:
        make_tiny_checkpoint(tmp_path, smollm_llm, kind)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB", max_model_len=96,
              max_num_seqs=6, kernel_backend=backend)
    prompts = [[(3 * i + j) % 50 + 200 for i in range(n)] for j, n in enumerate((5, 11, 17, 4, 9))]
    # Different lengths: the batch shrinks 5 -> 1 as requests finish, padded to sizes 6, 4, 2, 1 (few steps: the
    # Triton case runs in the interpreter at ~0.6 s a step).
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (2, 4, 6, 8, 10)]
    want = [r.token_ids for r in llm.generate(prompts, params)]
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, 6, 96, capture=False)
    assert [r.token_ids for r in llm.generate(prompts, params)] == want
    assert runner.graphs.num_runs >= 9  # every decode step (the longest request's 10th token) took the static path
    assert len(runner.graphs.slot_mapping) == runner.kv_cache.spec.groups.num_groups == (2 if kind == "gpt-oss" else 1)
    llm.engine.scheduler.check_integrity()
