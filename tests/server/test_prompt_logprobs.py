"""Prompt logprobs over the API, as the openai SDK parses them: ``echo`` + ``logprobs`` (OpenAI's legacy shape, the
prompt's first token null) streamed and not, and vLLM's ``prompt_logprobs``, each against transformers' log-softmax
on the same fp32 weights."""

import httpx
import openai
import pytest
import torch

from tests.live_server import API_KEY, MODEL

PROMPT = "The capital of France is Paris. The capital of Spain is"


@pytest.fixture(scope="module")
def client(fp32_server):
    return openai.OpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(smollm_hf):
    model, tokenizer = smollm_hf
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        return ids, model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_with_logprobs_scores_the_prompt(client, smollm_hf, reference):
    ids, logprobs = reference
    kwargs = dict(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = client.completions.create(**kwargs).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - logprobs[i - 1, ids[i]].item()) < 1e-4
        assert len(lp.top_logprobs[i]) == 2 and abs(max(lp.top_logprobs[i].values()) - logprobs[i - 1].max().item()) \
            < 1e-4
    assert "".join(lp.tokens[:len(ids)]) == smollm_hf[1].decode(ids) and choice.text.startswith(PROMPT)
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs:
            for key in streamed:
                streamed[key] += getattr(c.choices[0].logprobs, key)
    assert streamed == {key: getattr(lp, key) for key in streamed}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_vllm_prompt_logprobs(client, fp32_server, reference):
    ids, logprobs = reference
    choice = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 1}).choices[0]
    listed = choice.model_extra["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None and choice.logprobs is None
    for i in range(1, len(ids)):
        row = logprobs[i - 1]
        own = listed[i][str(ids[i])]
        assert abs(own["logprob"] - row[ids[i]].item()) < 1e-4 and own["rank"] == int((row > row[ids[i]]).sum()) + 1
        top = row.argmax().item()
        assert listed[i][str(top)]["rank"] == 1 and len(listed[i]) == (1 if top == ids[i] else 2)
    bad = httpx.post(fp32_server.base_url + "/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"model": MODEL, "prompt": ids, "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
