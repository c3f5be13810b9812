"""Structured outputs, tool calls, the strict contract, /tokenize and the OpenAPI document, judged by the official
openai SDK's own parsing (and jsonschema) against a live server on SmolLM2."""

import json
from enum import Enum
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.live_server import API_KEY, MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: Annotated[str, Field(max_length=20)]
    zip_code: Annotated[str, Field(max_length=8)] | None


class Person(BaseModel):
    name: Annotated[str, Field(max_length=20)]
    age: int
    favourite: Color
    hobbies: Annotated[list[Annotated[str, Field(max_length=16)]], Field(max_length=3)]
    address: Address


@pytest.fixture(scope="module")
def client(fp32_server):
    return openai.OpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0)


def test_parse_returns_a_nested_pydantic_object(client):
    messages = [{"role": "user", "content": "Invent a person living in Paris. Answer in JSON."}]
    for temperature in (0.0, 1.0):
        r = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Person,
                                          temperature=temperature, seed=5, max_tokens=200)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Person)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "Person", "strict": True,
                                                                "schema": Person.model_json_schema()}}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    jsonschema.validate(json.loads(streamed), Person.model_json_schema())


def test_guided_fields_on_both_endpoints(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["Paris", "Rome"]})
    assert r.choices[0].text in ("Paris", "Rome")
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{2} degrees"}})
    assert r.choices[0].message.content.endswith(" degrees") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_into_the_declared_arguments(client, tool_choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                       temperature=0, max_tokens=80, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(json.loads(call.function.arguments), declared[call.function.name])
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"


def test_streamed_tool_call_deltas_reassemble_into_the_same_call(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_full_tool_round_trip(client, fp32_server):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=80).choices[0].message
    result = {"temperature": 21, "sky": "sunny"}
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": json.dumps(result)}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=40).choices[0]
    assert final.finish_reason in ("stop", "length") and final.message.tool_calls is None and final.message.content
    # The call and its result reached the prompt, in the model's format (SmolLM2's template has no tool support).
    tokens = httpx.post(fp32_server.root + "/tokenize", json={"messages": history, "tools": [WEATHER]},
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]
    prompt = httpx.post(fp32_server.root + "/detokenize", json={"tokens": tokens},
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()["prompt"]
    assert first.tool_calls[0].function.arguments.replace("\n", "").replace(" ", "") in \
        prompt.replace("\n", "").replace(" ", "")
    assert "<tool_response>\n" + json.dumps(result) in prompt and '"name": "get_weather"' in prompt


def test_tokenize_and_detokenize(fp32_server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(fp32_server.root + "/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                          "return_token_strs": True}, headers=headers).json()
    assert r["tokens"] == [19556, 905] and r["token_strs"] == ["Hello", "Ġworld"] and r["count"] == 2
    chat = httpx.post(fp32_server.root + "/tokenize", json={"messages": ASK}, headers=headers).json()
    usage = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens and chat["max_model_len"] == 2048
    assert httpx.post(fp32_server.root + "/detokenize", json={"tokens": r["tokens"]},
                      headers=headers).json() == {"prompt": "Hello world"}
    bad = httpx.post(fp32_server.root + "/detokenize", json={"tokens": [10**9]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.0"
    assert httpx.post(fp32_server.root + "/tokenize", json={"prompt": "x"}).status_code == 401


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
def test_tokenize_renders_a_chat_as_chat_completions_does(fp32_server, client, tool_choice):
    """The prompt /tokenize counts is the one the chat completion was served from (usage.prompt_tokens), tools and
    tool_choice included: with "none" the tools are left out of both."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    counted = httpx.post(fp32_server.root + "/tokenize", json={"messages": ASK, "tools": [WEATHER], **extra},
                         headers=headers).json()["count"]
    served = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1,
                                            **extra).usage.prompt_tokens
    bare = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).usage.prompt_tokens
    assert counted == served
    assert (served == bare) == (tool_choice == "none")


def test_logprob_bytes_of_a_character_split_across_tokens(client):
    """A snowman (3 UTF-8 bytes) comes as byte pieces of a byte-level vocabulary: each piece's token text is only
    U+FFFD, but the pieces' bytes concatenate to the text's UTF-8 (OpenAI's bytes field)."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Draw snowmen."}],
                                       temperature=0, max_tokens=12, logprobs=True, top_logprobs=2,
                                       extra_body={"structured_outputs": {"regex": "☃☃"}})
    choice = r.choices[0]
    assert choice.message.content == "☃☃"
    content = choice.logprobs.content
    pieces = [bytes(t.bytes) for t in content]
    assert b"".join(pieces).removesuffix(b"<|im_end|>") == "☃☃".encode()  # the stop token ends the list
    assert any(p and not _decodes(p) for p in pieces), pieces  # at least one token is part of a character
    for t in content:  # a whole character's text is its bytes; a piece's text shows the replacement character
        assert t.token == bytes(t.bytes).decode() if _decodes(bytes(t.bytes)) else "\ufffd" in t.token
    for t in content:
        for top in t.top_logprobs:
            assert top.bytes is not None and (not _decodes(bytes(top.bytes)) or bytes(top.bytes).decode() == top.token)


def _decodes(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_unknown_fields_are_named(fp32_server):
    for body, param in [({"messages": ASK, "frobnicate": 1}, "frobnicate"),
                        ({"messages": [{**ASK[0], "mood": "happy"}]}, "messages.0.mood"),
                        ({"messages": ASK, "response_format": {"type": "json_object", "extra": 1}},
                         "response_format.extra")]:
        r = httpx.post(fp32_server.base_url + "/chat/completions", json={"model": MODEL, **body},
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert r.json()["error"]["message"].startswith("Unrecognized request argument supplied")


def test_list_limits_and_vllm_text_options(fp32_server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=["x"] * 65, max_tokens=1)
    assert err.value.body["param"] == "prompt" and err.value.body["code"] == "limit_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, tools=[
            {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)])
    assert err.value.body["param"] == "tools"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    kept = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=30, stop=[" is"],
                                          extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "The capital of France is"
    raw = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=30,
                                         extra_body={"skip_special_tokens": False})
    assert raw.choices[0].message.content == "The capital of France is Paris.<|im_end|>"


def test_body_size_limit(fp32_server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    big = b'{"model": "m", "prompt": "' + b"a" * (4 * 2**20) + b'"}'
    r = httpx.post(fp32_server.base_url + "/completions", content=big, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(fp32_server.base_url + "/completions", content=iter([big[:2**21], big[2**21:]]), headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"  # chunked, no length given


def test_openapi_lists_the_real_statuses_and_shapes(fp32_server, client):
    doc = httpx.get(fp32_server.root + "/openapi.json").json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat) == {"200", "400", "401", "404", "429", "500", "503"}
    resolver = {"components": doc["components"]}

    def check(response_schema: dict, body: dict) -> None:
        jsonschema.validate(body, {**response_schema, **resolver})

    error = httpx.post(fp32_server.base_url + "/chat/completions", json={"model": MODEL, "messages": []},
                       headers={"Authorization": f"Bearer {API_KEY}"}).json()
    check(chat["400"]["content"]["application/json"]["schema"], error)
    # The request schema is the contract the server enforces: what it accepts validates, an unknown field does not.
    request_schema = {**doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"][
        "schema"], **resolver}
    good = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 60,
            "temperature": 0, "response_format": {"type": "text"}, "stream_options": {"include_usage": True}}
    jsonschema.validate(good, request_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "frobnicate": 1}, request_schema)
    ok = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        max_tokens=60, temperature=0)
    check(chat["200"]["content"]["application/json"]["schema"], ok.model_dump(exclude_unset=True))
    models = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    check(models, httpx.get(fp32_server.base_url + "/models", headers={"Authorization": f"Bearer {API_KEY}"}).json())
