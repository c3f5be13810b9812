"""OpenAI's Responses API judged by the openai SDK's own parsing (and the OpenAI Agents SDK's run loop) against a live
server on SmolLM2: the same greedy answer and usage as chat completions, streams the SDK accumulates into the same
response, responses.parse under a schema, a function tool round trip through previous_response_id, the store scoped
to the caller's key, and OpenAI's error shape."""

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.live_server import ALICE_KEY, API_KEY, MODEL

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # transformers' greedy answer on the same weights (test_openai_sdk.py)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": PARAMETERS, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city",
                                                 "parameters": PARAMETERS}}


@pytest.fixture(scope="module")
def client(fp32_server):
    return openai.OpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0)


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def test_create_answers_as_chat_completions_do(client):
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=30)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.output_text == ANSWER
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    chat = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=30)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # instructions are a system message; typed items render as the string did; the token bound cuts it short
    cut = client.responses.create(model=MODEL, instructions="You answer in French.", max_output_tokens=2, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    system = _chat(client, [{"role": "system", "content": "You answer in French."},
                            {"role": "user", "content": QUESTION}], max_tokens=1)
    assert cut.usage.input_tokens == system.usage.prompt_tokens and cut.usage.output_tokens == 2
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"


def test_the_stream_accumulates_into_the_same_response(client):
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=30) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert final.output_text == ANSWER and final.status == "completed" and final.id == events[0].response.id
    chat = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=30)
    assert final.usage.output_tokens == chat.usage.completion_tokens


class City(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_parse_follows_the_schema(client):
    parsed = client.responses.parse(model=MODEL, input="Name a city and the country it is in.", text_format=City,
                                    temperature=0, max_output_tokens=80)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    jsonschema.validate(json.loads(parsed.output_text), City.model_json_schema())
    assert parsed.text.format.type == "json_schema"


def test_a_function_tool_round_trip(client):
    ask = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], temperature=0,
               tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    r = client.responses.create(**ask)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id and calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMETERS)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done[0].arguments == final.output[-1].arguments == calls[0].arguments
    # The result goes back on top of the stored conversation; the prompt is the whole conversation's, as chat's.
    result = "Sunny, 21 C"
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=20, input=[
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": result}])
    assert follow.previous_response_id == r.id and follow.output_text
    chat = _chat(client, [{"role": "user", "content": "What is the weather in Paris?"},
                          {"role": "assistant", "content": None, "tool_calls": [{
                              "id": calls[0].call_id, "type": "function",
                              "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                          {"role": "tool", "tool_call_id": calls[0].call_id, "content": result}],
                 tools=[CHAT_WEATHER], tool_choice="none", max_tokens=20)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens and follow.output_text == \
        chat.choices[0].message.content


def test_stored_responses_are_the_callers_own(client, fp32_server):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", QUESTION)]
    alice = openai.OpenAI(base_url=fp32_server.base_url, api_key=ALICE_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as missing:
        alice.responses.create(model=MODEL, input="And Spain?", previous_response_id=r.id, max_output_tokens=3)
    assert missing.value.body["code"] == "previous_response_not_found"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_errors_come_in_openais_shape(client, fp32_server):
    def refused(**fields):
        answer = httpx.post(fp32_server.base_url + "/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                            json={"model": MODEL, "input": QUESTION, **fields})
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]
    assert refused(tools=[{"type": "web_search"}])["param"].startswith("tools.0")
    assert refused(input=[{"type": "message", "role": "user", "content": [{"type": "input_image"}]}])["param"] == \
        "input.0.content.0"
    assert refused(background=True)["param"] == "background"
    assert refused(include=["file_search_call.results"])["param"] == "include.0"
    assert "Unrecognized" in refused(frobnicate=1)["message"]
    assert refused(input=[])["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=QUESTION)


def test_an_agents_sdk_agent_runs_a_tool_to_completion(fp32_server, monkeypatch):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    import agents
    from agents.models.openai_responses import OpenAIResponsesModel

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0))
    agent = agents.Agent(name="weather", instructions="You answer questions about the weather.", model=model,
                         tools=[get_weather], model_settings=agents.ModelSettings(
                             tool_choice="required", temperature=0, max_tokens=40))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    # The agent called the tool once (the SDK sets tool_choice back to auto after a call), then answered.
    assert len(calls) == 1 and calls[0]
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem", "ToolCallOutputItem",
                                                                    "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output


def test_openapi_documents_the_responses_operations(client, fp32_server):
    doc = httpx.get(fp32_server.root + "/openapi.json").json()
    resolver = {"components": doc["components"]}
    create = doc["paths"]["/v1/responses"]["post"]
    assert set(create["responses"]) == {"200", "400", "401", "404", "429", "500", "503"}
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    request_schema = {**create["requestBody"]["content"]["application/json"]["schema"], **resolver}
    good = {"model": MODEL, "input": QUESTION, "tools": [WEATHER], "max_output_tokens": 5,
            "text": {"format": {"type": "json_schema", "name": "city", "schema": PARAMETERS}}}
    jsonschema.validate(good, request_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "frobnicate": 1}, request_schema)
    body = httpx.post(fp32_server.base_url + "/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "input": QUESTION, "max_output_tokens": 3}).json()
    jsonschema.validate(body, {**create["responses"]["200"]["content"]["application/json"]["schema"], **resolver})
    error = httpx.post(fp32_server.base_url + "/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "input": []}).json()
    jsonschema.validate(error, {**create["responses"]["400"]["content"]["application/json"]["schema"], **resolver})
