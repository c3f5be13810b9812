"""The compiled layer stack (models/compile.py) against the eager one, on a tiny Llama: the same greedy tokens and
logits through chunked prefill and mixed batches, exactly two graphs compiled at warm-up and none while serving,
and a restart served from the on-disk cache."""

import torch
from torch._dynamo.utils import counters

from tests.helpers import teacher_forced_logits
from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill import LLM, SamplingParams

ENGINE = dict(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB", max_num_batched_tokens=8,
              num_threads=2)


def test_compiled_decoder_matches_eager_and_never_compiles_after_warm_up(tmp_path, smollm_llm):
    model_dir, cache = tmp_path / "model", tmp_path / "inductor"
    make_llama_checkpoint(model_dir, smollm_llm)
    eager = LLM(model=str(model_dir), enforce_eager=True, **ENGINE)
    graphs_before = counters["stats"]["unique_graphs"]
    compiled = LLM(model=str(model_dir), enforce_eager=False, compile_cache_dir=str(cache), **ENGINE)
    decoder = compiled.engine.runner.model.compiled_decoder
    assert decoder is not None and decoder.sealed
    assert counters["stats"]["unique_graphs"] - graphs_before == 2  # one token, and two or more
    assert any(cache.rglob("*")), "the generated code was not written to compile_cache_dir"

    # Prompts of 1..23 tokens in 8-token steps: decodes alone, prefill chunks alone, and mixed batches.
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in (1, 5, 8, 9, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    graphs_before = counters["stats"]["unique_graphs"]
    assert [r.token_ids for r in compiled.generate(prompts, params)] == \
        [r.token_ids for r in eager.generate(prompts, params)]
    ids = prompts[-1]
    for chunk in (None, 3, 1):
        got = teacher_forced_logits(compiled.engine.runner.model, compiled.engine.runner.kv_cache, ids, chunk)
        want = teacher_forced_logits(eager.engine.runner.model, eager.engine.runner.kv_cache, ids, chunk)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs_before, "serving compiled a new graph"

    # A restart: dynamo forgets what it traced in this process; the compiled artifacts come from compile_cache_dir.
    torch._dynamo.reset()
    hits_before = counters["aot_autograd"]["autograd_cache_hit"]
    LLM(model=str(model_dir), enforce_eager=False, compile_cache_dir=str(cache), **ENGINE)
    assert counters["aot_autograd"]["autograd_cache_hit"] - hits_before == 2


def test_processes_generating_code_for_different_isas_keep_separate_caches(tmp_path):
    """Inductor's cache key leaves out the vector ISA it generates for: a process held to AVX2 and an AVX-512 one
    sharing a directory ran each other's code (heap corruption). Each gets its own subdirectory, named for the ISA
    inductor picks in that process."""
    import os
    import subprocess
    import sys

    script = ("import sys; from torch._inductor.cpu_vec_isa import pick_vec_isa; "
              "from tokenmill.models.compile import use_cache_dir; "
              "print(use_cache_dir(sys.argv[1]).name, str(pick_vec_isa() or 'scalar'))")

    def cache_of(**env):
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env={**os.environ, **env},
                              capture_output=True, text=True, check=True)
        return done.stdout.split(maxsplit=1)

    host_dir, host_isa = cache_of()
    generic_dir, generic_isa = cache_of(ATEN_CPU_CAPABILITY="default")
    assert (tmp_path / host_dir).is_dir() and (tmp_path / generic_dir).is_dir()
    assert host_dir.startswith("isa-") and host_isa.split()[0] in host_dir
    # "default": ATen's generic level, where inductor generates no vector code
    assert generic_isa.strip() == "scalar" and generic_dir == "isa-scalar" and host_dir != generic_dir


def test_models_compiled_one_after_another_in_one_process_all_compile(tmp_path, smollm_llm):
    """Dynamo counts recompiles per code object (8): through the one ``DecoderLM.decoder`` code, the seventh model of
    other shapes compiled in one process (a fleet with --no-engine-process, restarts, a test session), each freed
    before the next, hit the limit and, the compile failing, ran eagerly. Each model now compiles code of its own."""
    import gc

    shapes = [("llama", 2, 16), ("llama", 1, 16), ("llama", 4, 16), ("llama", 2, 32), ("qwen2", 2, 16),
              ("qwen2", 1, 16), ("llama", 1, 32)]
    executions = []
    for i, (arch, kv_heads, head_dim) in enumerate(shapes):
        model_dir = tmp_path / f"model-{i}"
        make_llama_checkpoint(model_dir, smollm_llm, arch, num_kv_heads=kv_heads, head_dim=head_dim)
        llm = LLM(model=str(model_dir), enforce_eager=False, compile_cache_dir=str(tmp_path / "c"), **ENGINE)
        executions.append(llm.engine.info.execution)
        del llm
        gc.collect()
    assert executions == ["compiled"] * len(shapes)
