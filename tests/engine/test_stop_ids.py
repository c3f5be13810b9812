"""Every EOS id stops generation (config.json's, generation_config.json's, the tokenizer's), and min_tokens bans them
all (and the stop token ids) whatever ignore_eos says -- as vLLM and transformers do."""

import json

import pytest

from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.models.config import ModelConfig

SECOND_EOS = 7  # listed by generation_config.json only


@pytest.fixture(scope="module")
def multi_eos(tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp("multi-eos")
    make_llama_checkpoint(path, smollm_llm)
    first = smollm_llm.tokenizer.eos_token_id
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = first
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, SECOND_EOS]}))
    return LLM(model=str(path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB"), first


FORCE_SECOND = {SECOND_EOS: 100.0}  # the tiny random model's logits are small: +100 always wins


def test_every_eos_id_is_known(multi_eos):
    llm, first = multi_eos
    assert llm.engine.info.eos_token_ids == [first, SECOND_EOS]


def test_the_second_eos_id_stops(multi_eos):
    llm, _ = multi_eos
    r = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, logit_bias=FORCE_SECOND))[0]
    assert r.token_ids == [SECOND_EOS] and r.finish_reason == "stop"
    r = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, logit_bias=FORCE_SECOND,
                                                 ignore_eos=True))[0]
    assert r.token_ids == [SECOND_EOS] * 10 and r.finish_reason == "length"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_every_eos_id_whatever_ignore_eos(multi_eos, ignore_eos):
    llm, first = multi_eos
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, ignore_eos=ignore_eos,
                            logit_bias={SECOND_EOS: 100.0, first: 99.0, 11: 98.0}, stop_token_ids=[11])
    r = llm.generate([[1, 2, 3]], params)[0]
    assert not {SECOND_EOS, first, 11} & set(r.token_ids[:3])
    if ignore_eos:
        assert r.token_ids[3:] == [SECOND_EOS] * 5 and r.finish_reason == "length"
    else:
        assert r.token_ids[3:] == [SECOND_EOS] and r.finish_reason == "stop"


def test_llama3_style_eos_list_is_kept_whole():
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 1, "num_attention_heads": 4, "eos_token_id": [128001, 128008, 128009]}
    assert ModelConfig.from_hf(config, {"eos_token_id": 128009}, 128009).eos_token_ids == (128001, 128008, 128009)
