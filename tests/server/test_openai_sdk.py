"""The official openai SDK against a live server: its own parsing is the judge of the wire format."""

import asyncio

import httpx
import openai
import pytest

from tests.live_server import ALICE_KEY, API_KEY, CORS_ORIGIN, MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."  # transformers' greedy answer on the same weights


@pytest.fixture(scope="module")
def client(fp32_server):
    return openai.OpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def aclient(fp32_server):
    """A factory: an async client lives inside one event loop (each asyncio.run makes a new one)."""
    return lambda: openai.AsyncOpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0)


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 2048 and models[0].owned_by == "tokenmill"


def test_chat_non_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 8  # 7 text tokens + <|im_end|>
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30,
                                                 stream=True))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])


def test_include_usage_comes_once_at_the_end(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_n_choices_are_indexed(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, temperature=1.0, seed=3, max_tokens=12)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 24  # 12 per choice, no EOS within 12 tokens at this seed
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, n=2, temperature=1.0, seed=3,
                                                 max_tokens=12, stream=True))
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                for i in (0, 1)}
    assert streamed == {c.index: c.message.content for c in r.choices}


def test_seed_reproducible(client):
    def ask(seed):
        return client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0, seed=seed,
                                              max_tokens=20).choices[0].message.content
    assert ask(11) == ask(11)
    assert len({ask(11), ask(12), ask(13)}) > 1


def test_stop_sequence(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, stop=[" Paris"], max_tokens=30)
    assert r.choices[0].message.content == "The capital of France is"
    assert r.choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy picks the most likely token
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode() == t.token


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=5,
                                  temperature=0, n=2, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices of a prompt agree
    assert r.choices[0].text.startswith(" Paris")
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert r.usage.completion_tokens == 20
    echo = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                     echo=True)
    assert echo.choices[0].text.startswith("The capital of France is Paris")
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=2, temperature=0)
    assert ids.choices[0].text == r.choices[0].text[:len(ids.choices[0].text)]


def test_completions_stream(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_concurrent(aclient):
    async def run():
        client = aclient()
        return await asyncio.gather(*[client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=30) for _ in range(4)])
    results = asyncio.run(run())
    assert all(r.choices[0].message.content == ANSWER for r in results)


def test_async_stream(aclient):
    async def run():
        stream = await aclient().chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                                       max_tokens=30, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])
    assert asyncio.run(run()) == ANSWER


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 100_000}, "messages"),
    ({"logit_bias": {"999999999": 5}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_regex": "(a"}}, "guided_regex"),
    ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop": "s" * 257}, "stop"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"extra_body": {"stop_token_ids": list(range(257))}}, "stop_token_ids"),
    ({"n": 17}, "n"),
])
def test_bad_values_are_400_naming_the_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param
    if param == "messages":
        assert err.value.body["code"] == "context_length_exceeded"


def test_auth_and_model_errors(fp32_server, client):
    bad = openai.OpenAI(base_url=fp32_server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model=MODEL, messages=QUESTION)
    assert err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert err.value.body["code"] == "model_not_found"
    alice = openai.OpenAI(base_url=fp32_server.base_url, api_key=ALICE_KEY, max_retries=0)
    assert alice.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices
    assert httpx.get(fp32_server.root + "/health").status_code == 200  # open without a key


@pytest.mark.parametrize("body", [
    b"{not json", b"[]", b'{"model": "SmolLM2-135M-Instruct"}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": "hi"}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "wizard", "content": "x"}]}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [], "max_tokens": 5}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e300}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "seed": 1e30}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
])
def test_malformed_bodies_are_400_never_422_or_500(fp32_server, body):
    r = httpx.post(fp32_server.base_url + "/chat/completions", content=body,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_bad_requests_do_not_disturb_a_running_stream(fp32_server, aclient):
    async def run():
        client = aclient()
        stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                                      max_tokens=30, stream=True)
        async with httpx.AsyncClient(base_url=fp32_server.base_url,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as raw:
            bad = await asyncio.gather(*[raw.post("/chat/completions", content=body) for body in (
                b"{", b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
                      b'"max_tokens": 999999}', b'{"model": 5}') * 3])
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        return text, [r.status_code for r in bad]
    text, codes = asyncio.run(run())
    assert text == ANSWER and set(codes) == {400}


def test_cors_preflight(fp32_server):
    r = httpx.options(fp32_server.base_url + "/chat/completions", headers={
        "Origin": CORS_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == CORS_ORIGIN
    other = httpx.options(fp32_server.base_url + "/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"
