"""The families of models/families.py, each a tiny random checkpoint written by transformers
(tests/family_checkpoints.py): served through /v1/completions with prefix caching on, chunked prefill and a KV cache
small enough to preempt, the greedy text equals transformers' greedy tokens decoded (fp32); two tensor-parallel ranks
equal transformers too (Qwen3-MoE, gpt-oss); gpt-oss with MXFP4 experts equals transformers loading the same
file dequantized; unknown families and unsupported fields are one clear error before any weight is read."""

import copy
import json

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import hf_greedy
from tests.family_checkpoints import FAMILIES, make_family_checkpoint, write_mxfp4_copy
from tests.live_server import inprocess_server
from tokenmill import LLM, SamplingParams
from tokenmill.models.config import ModelConfig
from tokenmill.models.loader import ModelLoadError

NEW_TOKENS = 12
BASE = [(7 * i) % 997 + 100 for i in range(40)]
FIRST = BASE[:20]
# Sharing FIRST's blocks (prefix cache hits once it ran), a short one, and one past every window.
PROMPTS = [BASE[:20] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], BASE[:7], BASE[:20], BASE[3:36]]
BLOCK = 4
CAPACITY = 56  # tokens: fewer than PROMPTS need together (preemption), enough for the longest alone
CHUNK = 8


def metric(root: str, name: str) -> float:
    text = httpx.get(root + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in (name, name + "_total"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_served_greedy_text_equals_transformers(tmp_path, smollm_llm, family):
    tokenizer = smollm_llm.tokenizer.hf
    hf = make_family_checkpoint(tmp_path, tokenizer, family)
    expected = [tokenizer.decode(hf_greedy(hf, p, NEW_TOKENS), skip_special_tokens=True) for p in PROMPTS]
    spec = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text())).kv_cache_spec("fp32", BLOCK)
    # Blocks for the longest request alone (sliding-window layers hold only their window and the chunk), the null one.
    num_blocks = spec.groups.blocks_for(CAPACITY, BLOCK, CHUNK) + 1
    with inprocess_server(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", block_size=BLOCK,
                          kv_cache_memory=num_blocks * spec.bytes_per_block, max_model_len=CAPACITY,
                          max_num_batched_tokens=CHUNK, enable_prefix_caching=True) as (root, _):
        served = httpx.get(root + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = dict(model=served, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        first = httpx.post(root + "/v1/completions", json={**body, "prompt": [FIRST]}, timeout=120)
        assert first.status_code == 200, first.text
        response = httpx.post(root + "/v1/completions", json={**body, "prompt": PROMPTS}, timeout=300)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == expected
        assert first.json()["choices"][0]["text"] == expected[2]
        assert metric(root, "tokenmill:prefix_cache_hits") > 0
        assert metric(root, "tokenmill:num_preemptions") >= 1


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe", "gpt-oss"])
def test_two_ranks_equal_transformers(tmp_path, smollm_llm, family):
    from tests.engine.test_tensor_parallel import two_ranks_match

    two_ranks_match(tmp_path, make_family_checkpoint(tmp_path, smollm_llm.tokenizer.hf, family))


def test_gpt_oss_mxfp4_experts_equal_transformers_dequantized(tmp_path, smollm_llm):
    import transformers

    make_family_checkpoint(tmp_path, smollm_llm.tokenizer.hf, "gpt-oss")
    write_mxfp4_copy(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB",
              max_num_batched_tokens=8)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(PROMPTS, greedy)] == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def _config(tmp_path, smollm_llm, family, **changes):
    make_family_checkpoint(tmp_path, smollm_llm.tokenizer.hf, family)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not read")  # an error must come before any weight is read


@pytest.mark.parametrize("family,changes,message", [
    ("qwen3", {"architectures": ["Qwen9ForCausalLM"]}, "unsupported architecture 'Qwen9ForCausalLM'"),
    ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope_parameters rope_type 'longrope' is not supported"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "dynamic", "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention rope_type 'dynamic'"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gpt-oss", {"layer_types": ["chunked_attention"] * 4}, r"layer_types \['chunked_attention'\]"),
    ("gemma3", {"hidden_activation": "relu"}, "hidden_act 'relu'"),
    ("qwen3", {"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4 is supported for GptOssForCausalLM"),
])
def test_unsupported_fields_are_one_clear_error(tmp_path, smollm_llm, family, changes, message):
    _config(tmp_path, smollm_llm, family, **changes)
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(tmp_path), dtype="float32")


def test_kimi_k2_remote_code_tokenizer_is_one_error_that_says_what_to_do(tmp_path, smollm_llm):
    """Kimi-K2 ships a tiktoken tokenizer built by its own tokenization_kimi.py (no tokenizer.json)."""
    _config(tmp_path, smollm_llm, "kimi-k2")
    (tmp_path / "tokenizer.json").unlink()
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "tiktoken.model").write_text("IQ== 0\n")
    (tmp_path / "tokenization_kimi.py").write_text("raise SystemExit('a checkpoint's code must never run')\n")
    with pytest.raises(ModelLoadError, match=r"tokenization_kimi\.py.*no tokenizer\.json.*save_pretrained"):
        LLM(model=str(tmp_path), dtype="float32")


def test_template_stop_tokens_end_a_response_without_a_generation_config(tmp_path, smollm_llm):
    """gpt-oss ends a response with <|return|> and a tool call with <|call|>: both stop, config or not."""
    tokenizer = copy.deepcopy(smollm_llm.tokenizer.hf)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|return|>", "<|call|>"]})
    make_family_checkpoint(tmp_path, tokenizer, "gpt-oss")
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    call = tokenizer.convert_tokens_to_ids("<|call|>")
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB")
    forced = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, logit_bias={call: 100.0}))[0]
    assert (forced.token_ids, forced.finish_reason) == ([call], "stop")
    assert tokenizer.convert_tokens_to_ids("<|return|>") in llm.engine.model_config.eos_token_ids


def test_glm_multi_token_prediction_layer_is_skipped(tmp_path, smollm_llm):
    """GLM-4.5 checkpoints ship their MTP layer as layer num_hidden_layers (num_nextn_predict_layers: 1): it is not
    run, and its tensors neither fail the load nor change the tokens."""
    from safetensors.torch import load_file, save_file

    hf = make_family_checkpoint(tmp_path, smollm_llm.tokenizer.hf, "glm4-moe")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    last = hf.config.num_hidden_layers - 1
    tensors.update({n.replace(f"layers.{last}.", f"layers.{last + 1}."): t.clone()
                    for n, t in tensors.items() if f"layers.{last}." in n})
    tensors[f"model.layers.{last + 1}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, file, metadata={"format": "pt"})
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB")
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(PROMPTS[:2], greedy)] == \
        [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS[:2]]


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path, smollm_llm):
    """Gemma3ForConditionalGeneration as released (language_model.model.*, a vision tower, text_config): the text
    model's greedy tokens equal transformers' on the whole checkpoint fed text only."""
    import transformers

    from tests.family_checkpoints import COMMON

    tokenizer = smollm_llm.tokenizer.hf
    text = {**COMMON, **FAMILIES["gemma3"][1], "vocab_size": len(tokenizer)}
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, mm_tokens_per_image=4, vision_config=dict(
            hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14))).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="16MiB")
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [r.token_ids for r in llm.generate(PROMPTS[:2], greedy)] == \
        [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS[:2]]
