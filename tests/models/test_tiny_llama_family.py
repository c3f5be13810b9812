"""Tiny random Llama/Qwen2 checkpoints written by transformers (safetensors + tokenizer), loaded from the
directory by tokenmill: logits equal transformers' for each RoPE scaling kind; greedy decoding equals too."""

import json

import pytest
import torch

from tests.conftest import hf_greedy
from tests.helpers import prefill_logits
from tokenmill import LLM, SamplingParams
from tokenmill.models.loader import ModelLoadError
from tests.tiny_checkpoints import make_llama_checkpoint

ROPE_KINDS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("kind", list(ROPE_KINDS))
def test_rope_kinds_match_transformers_logits(tmp_path, smollm_llm, kind):
    hf = make_llama_checkpoint(tmp_path, smollm_llm, rope=ROPE_KINDS[kind])
    written = json.loads((tmp_path / "config.json").read_text())
    if ROPE_KINDS[kind]:
        assert (written.get("rope_parameters") or written.get("rope_scaling"))["rope_type"] == kind
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB")
    ids = torch.randint(0, 1000, (100,)).tolist()  # positions past original_max_position_embeddings
    engine = llm.engine
    ours = prefill_logits(engine.runner.model, engine.runner.kv_cache, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_qwen2_biases_and_greedy_decode(tmp_path, smollm_llm):
    hf = make_llama_checkpoint(tmp_path, smollm_llm, arch="qwen2")
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB",
              max_num_batched_tokens=8)
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in (1, 9, 16, 23)]
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == [hf_greedy(hf, p, 32) for p in prompts]


def test_missing_and_malformed_models_give_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(model=str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLM(model=str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(model=str(tmp_path))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(model=str(bad))
