"""Keys as tenants ([[keys]]): the token buckets against their formula on a fake clock, the config's validation, and a
live server read through the openai SDK itself (its error parsing, its own Retry-After handling)."""

import hashlib
import json
import time

import httpx
import openai
import pytest
import torch

from tests.live_server import inprocess_server
from tokenmill.config import ConfigError, load_config
from tokenmill.key_policy import KeyPolicy
from tokenmill.server.auth import authenticator_for
from tokenmill.server.errors import APIError
from tokenmill.server.tenants import Tenants, duration


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_token_buckets_refill_at_limit_per_minute():
    """A request is taken at the edge (``enter``), its promise once known (``charge``); refusals take nothing."""
    clock = Clock()
    tenants = Tenants([KeyPolicy(name="a", key="k", rpm=2, tpm=600)], clock)
    tenants.enter("a")
    first = tenants.charge("a", 500)
    assert tenants.headers("a")["x-ratelimit-remaining-tokens"] == "100"
    assert tenants.headers("a")["x-ratelimit-remaining-requests"] == "1"
    with pytest.raises(APIError) as refused:  # 200 tokens: 100 missing at 10 a second
        tenants.charge("a", 200)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.headers["Retry-After"] == "10" and refused.value.type == "tokens"
    assert tenants.headers("a")["x-ratelimit-remaining-tokens"] == "100"  # the refusal took nothing
    clock.now += 10
    tenants.enter("a")
    tenants.charge("a", 200)  # exactly fits after the wait it was told
    with pytest.raises(APIError) as refused:  # 1/3 of a request left (10 s at 2 a minute): 2/3 more take 20 s
        tenants.enter("a")
    assert refused.value.type == "requests" and refused.value.headers["Retry-After"] == "20"
    first.settle(120)  # used 120 of its 500: 380 back, once
    first.settle(0)
    assert tenants.headers("a")["x-ratelimit-remaining-tokens"] == "380"
    assert tenants.headers("a")["x-ratelimit-reset-tokens"] == "22s"  # (600 - 380) / 10
    with pytest.raises(APIError, match="Request too large"):
        tenants.charge("a", 601)


def test_a_key_without_limits_is_not_metered_and_model_lists_are_exact():
    tenants = Tenants([KeyPolicy(name="a", key="k", models=["m1"]), KeyPolicy(name="b", key="j")])
    assert tenants.headers("a") == {} and tenants.headers(None) == {}
    assert tenants.may_use("a", "m1") and not tenants.may_use("a", "m2")
    assert tenants.may_use("b", "m2") and tenants.may_use(None, "m2") and tenants.may_use("key-1", "m2")
    with pytest.raises(APIError) as refused:
        tenants.check_model("a", "m2")
    assert refused.value.status == 404 and refused.value.code == "model_not_found"


@pytest.mark.parametrize("seconds,text", [(0.0199, "20ms"), (1.5, "1.5s"), (8.641, "8.65s"), (360, "6m0s"),
                                          (61.2, "1m2s")])
def test_reset_durations_read_like_openai(seconds, text):
    assert duration(seconds) == text


def test_keys_from_toml_with_a_sha256_and_their_errors(tmp_path):
    digest = hashlib.sha256(b"sk-team").hexdigest()
    toml = tmp_path / "tenants.toml"
    toml.write_text(f'[[keys]]\nname = "team"\nkey_sha256 = "{digest}"\nmodels = ["m"]\ntpm = 1000\n\n'
                    '[[keys]]\nname = "ops"\nkey = "sk-ops"\npriority = "batch"\n')
    config = load_config(toml)
    assert [k.name for k in config.keys] == ["team", "ops"] and config.keys[0].models == ("m",)
    auth = authenticator_for(config)
    assert auth.check("Bearer sk-team") == "team" and auth.check(None, "sk-ops") == "ops"
    with pytest.raises(APIError):
        auth.check("Bearer " + digest)  # the digest itself is not a key
    bad = [({"name": "x"}, "exactly one of key and key_sha256"),
           ({"name": "x", "key": "a", "key_sha256": digest}, "exactly one"),
           ({"name": "x", "key_sha256": "abc"}, "64 hexadecimal"),
           ({"name": "x", "key": "sk-secret-value", "rpm": 0}, "greater than 0"),
           ({"name": "x", "key": "sk-secret-value", "color": "red"}, "Extra inputs")]
    for entry, message in bad:
        with pytest.raises(ConfigError, match=message) as error:
            load_config(keys=[entry])
        assert "sk-secret-value" not in str(error.value)  # a key is never echoed
    with pytest.raises(ConfigError, match="share the key"):
        load_config(keys=[{"name": "x", "key": "sk-team"}, {"name": "y", "key_sha256": digest}])
    with pytest.raises(ConfigError, match="share the name"):
        load_config(keys=[{"name": "x", "key": "a"}, {"name": "x", "key": "b"}])
    with pytest.raises(ConfigError, match="key names given twice"):  # --api-key's first key is named key-1
        authenticator_for(load_config(api_key=["sk-a"], keys=[{"name": "key-1", "key": "sk-b"}]))


def test_live_keys_limit_models_and_token_rates(tmp_path, smollm_llm):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(smollm_llm.tokenizer.hf), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=8192, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    smollm_llm.tokenizer.hf.save_pretrained(tmp_path)
    keys = [{"name": "limited", "key": "sk-limited", "models": ["another-model"]},
            {"name": "metered", "key_sha256": hashlib.sha256(b"sk-metered").hexdigest(), "rpm": 1000, "tpm": 6000},
            {"name": "open", "key": "sk-open"}]
    with inprocess_server(model=str(tmp_path), served_model_name="tiny", dtype="float32", kv_cache_memory="16MiB",
                          enforce_eager=True, keys=keys) as (root, _):
        def client(key, **kw):
            return openai.OpenAI(base_url=root + "/v1", api_key=key, **kw)

        limited = client("sk-limited", max_retries=0)
        assert limited.models.list().data == []
        with pytest.raises(openai.NotFoundError) as refused:
            limited.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert refused.value.code == "model_not_found" and "do not have access" in refused.value.message
        assert [m.id for m in client("sk-open").models.list().data] == ["tiny"]

        metered = client("sk-metered", max_retries=0)
        long_prompt = list(range(1000, 6800))  # 5,800 tokens + 1 promised of 6,000 a minute
        started = time.monotonic()
        raw = metered.completions.with_raw_response.create(model="tiny", prompt=long_prompt, max_tokens=1)
        elapsed = time.monotonic() - started
        assert raw.parse().usage.prompt_tokens == 5800
        assert raw.headers["x-ratelimit-limit-tokens"] == "6000" and raw.headers["x-ratelimit-limit-requests"] == "1000"
        assert 199 <= int(raw.headers["x-ratelimit-remaining-tokens"]) <= 199 + 100 * elapsed + 1
        with pytest.raises(openai.RateLimitError) as refused:  # 10 + 400 promised: ~200 missing at 100 a second
            metered.completions.create(model="tiny", prompt=list(range(1000, 1010)), max_tokens=400)
        assert refused.value.code == "rate_limit_exceeded" and "TPM" in refused.value.message
        headers = refused.value.response.headers
        assert 1 <= int(headers["retry-after"]) <= 3 and headers["x-ratelimit-limit-tokens"] == "6000"
        with pytest.raises(openai.RateLimitError, match="Request too large"):
            metered.completions.create(model="tiny", prompt=list(range(1000, 1010)), max_tokens=6000)
        # The SDK waits the Retry-After it is given and tries again: that attempt fits.
        answer = client("sk-metered", max_retries=2).completions.create(
            model="tiny", prompt=list(range(1000, 1010)), max_tokens=400, extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 400

        with httpx.stream("POST", root + "/v1/chat/completions", headers={"Authorization": "Bearer sk-metered"},
                          json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                "stream": True}, timeout=60) as streamed:
            assert streamed.status_code == 200 and streamed.headers["x-ratelimit-limit-tokens"] == "6000"
            assert "data: [DONE]" in streamed.read().decode()
        plain = httpx.post(root + "/v1/completions", headers={"Authorization": "Bearer sk-open"}, timeout=60,
                           json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert plain.status_code == 200 and not any(h.startswith("x-ratelimit") for h in plain.headers)
        metrics = httpx.get(root + "/metrics").text
        assert 'reason="key_rate_limit"} 3.0' in metrics  # two refusals above, the SDK's first try
        assert json.loads(httpx.post(root + "/v1/completions", headers={"Authorization": "Bearer sk-metered!"},
                                     json={"model": "tiny", "prompt": "Hi"}).text)["error"]["code"] == "invalid_api_key"


def test_the_readme_example_is_a_valid_config(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("**Keys as tenants**", 1)[1].split("```toml", 1)[1].split("```", 1)[0]
    (tmp_path / "keys.toml").write_text("\n".join(line.strip() for line in block.splitlines()))
    keys = load_config(tmp_path / "keys.toml").keys
    assert [(k.name, k.priority) for k in keys] == [("team-a", "interactive"), ("nightly-evals", "batch")]
    assert authenticator_for(load_config(tmp_path / "keys.toml")).check("Bearer sk-team-a") == "team-a"
