"""Anthropic's Messages API judged by the official anthropic SDK's own parsing, against a live server on SmolLM2:
the same greedy answer as chat completions, streams that the SDK accumulates into the same message, a forced tool
call and its round trip, count_tokens, stop sequences, x-api-key auth and Anthropic's error shape."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.live_server import API_KEY, MODEL

anthropic = pytest.importorskip("anthropic")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."  # transformers' greedy answer on the same weights (test_openai_sdk.py)
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # today's SDK has no temperature argument (Anthropic's default is 1.0)


@pytest.fixture(scope="module")
def client(fp32_server):
    return anthropic.Anthropic(base_url=fp32_server.root, api_key=API_KEY, max_retries=0)


def test_messages_create_answers_as_chat_completions_do(client, fp32_server):
    m = client.messages.create(model=MODEL, max_tokens=30, messages=QUESTION, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ANSWER
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    chat = openai.OpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=QUESTION, extra_body=GREEDY, max_tokens=30)
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_system_prompt_and_max_tokens(client, fp32_server):
    m = client.messages.create(model=MODEL, max_tokens=3, system="You answer in French.", messages=QUESTION,
                               extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    chat = openai.OpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You answer in French."}, *QUESTION], max_tokens=1)
    counted = client.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "You answer in French."}],
                                           messages=QUESTION)
    assert counted.input_tokens == chat.usage.prompt_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_the_stream_accumulates_into_the_same_message(client, fp32_server):
    whole = client.messages.create(model=MODEL, max_tokens=30, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=30, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ANSWER and final.content[0].text == ANSWER
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    with httpx.stream("POST", fp32_server.root + "/v1/messages", headers={"x-api-key": API_KEY}, json={
            "model": MODEL, "max_tokens": 30, "messages": QUESTION, **GREEDY, "stream": True}) as r:
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) == {"content_block_delta"}


def test_a_stop_sequence_is_reported(client):
    m = client.messages.create(model=MODEL, max_tokens=30, messages=QUESTION, extra_body=GREEDY,
                               stop_sequences=["Paris"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "Paris")
    assert m.content[0].text == "The capital of France is "


def test_a_forced_tool_call_and_its_round_trip(client):
    m = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER], extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "get_weather",
                                            "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # Streamed: the SDK rebuilds the same call from input_json_delta fragments.
    with client.messages.stream(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    (again,) = [b for b in streamed.content if b.type == "tool_use"]
    assert (again.name, again.input, streamed.stop_reason) == (call.name, call.input, "tool_use")
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": '{"temperature": 21, "sky": "sunny"}'}]}]
    final = client.messages.create(model=MODEL, max_tokens=30, messages=history, tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "none"})
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    assert final.content[0].text
    # The call and its result reached the prompt: it is longer than the question alone by both.
    with_result = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER]).input_tokens
    assert with_result > client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens + 10


def test_errors_come_in_anthropics_shape(client, fp32_server):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=5, messages=QUESTION)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=fp32_server.root, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError) as thinking:
        client.messages.create(model=MODEL, max_tokens=50, messages=QUESTION,
                               thinking={"type": "enabled", "budget_tokens": 20})
    assert thinking.value.body["error"] == {"type": "invalid_request_error", "message": thinking.value.body[
        "error"]["message"]} and "thinking" in thinking.value.body["error"]["message"]
    bad = httpx.post(fp32_server.root + "/v1/messages", headers={"x-api-key": API_KEY}, json={
        "model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert bad.status_code == 400 and bad.json()["type"] == "error" and "messages.0.content.0" in \
        bad.json()["error"]["message"]
    unknown = httpx.post(fp32_server.root + "/v1/messages", headers={"x-api-key": API_KEY}, json={
        "model": MODEL, "max_tokens": 5, "messages": QUESTION, "frobnicate": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["type"] == "invalid_request_error"


def test_output_config_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_openapi_documents_anthropics_shapes(client, fp32_server):
    doc = httpx.get(fp32_server.root + "/openapi.json").json()
    operation = doc["paths"]["/v1/messages"]["post"]["responses"]
    resolver = {"components": doc["components"]}
    error = httpx.post(fp32_server.root + "/v1/messages", headers={"x-api-key": API_KEY},
                       json={"model": MODEL, "max_tokens": 0, "messages": QUESTION}).json()
    jsonschema.validate(error, {**operation["400"]["content"]["application/json"]["schema"], **resolver})
    ok = client.messages.with_raw_response.create(model=MODEL, max_tokens=5, messages=QUESTION, extra_body=GREEDY)
    jsonschema.validate(ok.http_response.json(), {**operation["200"]["content"]["application/json"]["schema"],
                                                  **resolver})
