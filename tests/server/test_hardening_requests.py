"""Bounds at the edge: every number of every API within what the engine holds, bodies bounded before they are parsed,
a key checked before its body is read, errors that name the request and never an exception's text. The exact requests
that stopped the engine, or answered 500, before. A tiny random Llama with SmolLM2's tokenizer, in process."""

import json
import math
import socket
import time

import httpx
import pytest
from pydantic import BaseModel

from tests.live_server import inprocess_server
from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill.sampling.params import INT64_MAX, INT64_MIN

KEY = "sk-hardening"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp("hardening")
    make_llama_checkpoint(path, smollm_llm)
    with inprocess_server(model=str(path), served_model_name="tiny", dtype="float32", kv_cache_memory="16MiB",
                          enforce_eager=True, api_key=[KEY], body_read_timeout_s=2.0, max_json_depth=32,
                          request_output_budget_bytes="1MiB") as running:
        yield running


def post(root: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(root + path, json=body, headers=HEADERS, timeout=60, **kw)


def healthy(root: str) -> None:
    """The engine still serves: a plain request completes (and the server says it is live)."""
    assert httpx.get(root + "/health", timeout=10).status_code == 200
    r = post(root, "/v1/chat/completions", CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def refused(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


def test_the_requests_that_stopped_the_engine_are_refused_or_served(server):
    root, _ = server
    refused(post(root, "/v1/completions", {"model": "tiny", "prompt": "Hi", "top_k": 2**63}), "top_k")
    refused(post(root, "/v1/completions", {"model": "tiny", "prompt": "Hi", "min_tokens": 2**63}), "min_tokens")
    # Within int64 but beyond the completion's room: what the engine's arrays would have taken is refused too.
    error = refused(post(root, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": None,
                                                  "min_tokens": INT64_MAX}), "min_tokens")
    assert "completion's length" in error["message"]
    # The largest seed with n = 2: its choices' seeds wrap within int64, reproducibly.
    seeded = {**CHAT, "n": 2, "seed": INT64_MAX, "temperature": 1.0, "max_tokens": 8}
    first, again = (post(root, "/v1/chat/completions", seeded) for _ in range(2))
    assert first.status_code == 200, first.text
    assert [c["message"]["content"] for c in first.json()["choices"]] == \
           [c["message"]["content"] for c in again.json()["choices"]]
    refused(post(root, "/v1/chat/completions", {**CHAT, "seed": INT64_MAX + 1}), "seed")
    refused(post(root, "/v1/chat/completions", {**CHAT, "seed": INT64_MIN - 1}), "seed")
    healthy(root)


def test_the_requests_that_answered_500_are_400s(server):
    root, _ = server
    usage = httpx.get(root + "/v1/usage", params={"start": "1e300"}, headers=HEADERS, timeout=30)
    refused(usage, "start")
    for value in ("-1", "nan", "inf", "10000-01-01T00:00:00"):
        assert httpx.get(root + "/v1/usage", params={"end": value}, headers=HEADERS).status_code == 400, value
    assert httpx.get(root + "/v1/usage", params={"start": "2026-01-01T00:00:00Z"}, headers=HEADERS).status_code == 200
    for key in ("²", "١", "-1", "1.5", "99999999999999999999"):
        refused(post(root, "/v1/completions", {"model": "tiny", "prompt": "Hi", "logit_bias": {key: 1}}), "logit_bias")
    healthy(root)


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("top_p", float("inf")), ("presence_penalty", -math.inf),
    ("frequency_penalty", 1e308), ("logit_bias", {"5": float("nan")}), ("n", 2**64), ("max_tokens", 2**64),
    ("logprobs", 2**31), ("stop_token_ids", [2**64]), ("prompt", [2**63]), ("best_of", 0), ("top_k", -2),
    ("top_p", 1e-320), ("top_k", 2**64), ("seed", 10**30)])
def test_boundary_numbers_are_400s_naming_the_field(server, field, value):
    root, _ = server
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2, field: value})  # NaN and Infinity literals
    r = httpx.post(root + "/v1/completions", content=body, timeout=30,
                   headers={**HEADERS, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field, r.json()


def test_every_number_of_every_request_body_is_bounded(server):
    """Through the server's own OpenAPI document: every integer of every request body has both bounds within int64;
    every model a body is built from refuses NaN and Infinity."""
    root, state = server
    spec = httpx.get(root + "/openapi.json", timeout=30).json()
    schemas, unbounded = spec["components"]["schemas"], []

    def walk(node, where: str) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer":
                low, high = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum")
                if low is None or high is None or low < INT64_MIN or high > INT64_MAX:
                    unbounded.append(where)
            if "$ref" in node:
                return
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    bodies = [op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
              for path in spec["paths"].values() for op in path.values() if "requestBody" in op]
    assert {"ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest",
            "CountTokensRequest", "EmbeddingRequest", "TokenizeRequest", "DetokenizeRequest"} <= set(bodies)
    reached, todo = set(), list(bodies)
    while todo:  # the request bodies' schemas and every schema they refer to
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [ref.rsplit("/", 1)[1] for ref in _refs(schemas[name])]
    for name in reached:
        walk(schemas[name], name)
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for parameter in op.get("parameters", []):
                walk(parameter.get("schema", {}), f"{method} {path} {parameter['name']}")
    assert not unbounded, unbounded

    import inspect

    from tokenmill.server import anthropic, embeddings, protocol, responses_input

    requests = {model for module in (protocol, anthropic, responses_input, embeddings)
                for _, model in inspect.getmembers(module, inspect.isclass)
                if issubclass(model, BaseModel) and model.__module__ == module.__name__}
    assert {m.__name__ for m in requests} >= set(bodies)
    for model in requests:
        assert model.model_config.get("allow_inf_nan") is False, model


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in _refs(v)]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


def read_response(sock: socket.socket) -> str:
    """One HTTP/1.1 response with a content-length, whole."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            data.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data.decode()


def test_a_missing_key_is_refused_before_the_body_is_read(server):
    """The body announced and never sent: the 401 comes at once, not after the body-read timeout."""
    root, _ = server
    host, port = root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 3000000\r\n\r\n{\"model\":")
        answer = read_response(sock)
        assert time.monotonic() - started < 1.5
    assert answer.startswith("HTTP/1.1 401") and '"invalid_api_key"' in answer


def test_bodies_are_bounded_in_size_read_time_and_depth(server):
    root, _ = server
    host, port = root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # with a key: the body's time is bounded
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 300\r\n\r\n{\"model\":")
        answer = read_response(sock)
    assert answer.startswith("HTTP/1.1 408") and '"request_timeout"' in answer
    deep = {**CHAT, "metadata": None, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": json.loads('{"a":' * 40 + "1" + "}" * 40)}}]}
    error = refused(post(root, "/v1/chat/completions", deep), None)
    assert error["code"] == "nested_too_deeply"
    bracketed = {**CHAT, "messages": [{"role": "user", "content": "[[[[" * 100}]}  # brackets in a string are text
    assert post(root, "/v1/chat/completions", bracketed).status_code == 200
    huge = httpx.post(root + "/v1/completions", content=b"[" + b"1," * (3 * 2**20) + b"1]", timeout=60,
                      headers={**HEADERS, "content-type": "application/json"})
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "request_too_large"
    bad_utf8 = httpx.post(root + "/v1/completions", content=b'{"model": "tiny", "prompt": "\xff\xfe"}', timeout=30,
                          headers={**HEADERS, "content-type": "application/json"})
    assert bad_utf8.status_code == 400 and set(bad_utf8.json()["error"]) == {"message", "type", "param", "code"}
    healthy(root)


def test_chat_template_kwargs_cannot_set_what_the_renderer_sets(server):
    """Every argument of transformers' apply_chat_template and of its renderer, and every special token's name, is
    refused by name (the list is checked against transformers' own signatures and attributes)."""
    import inspect

    from transformers import PreTrainedTokenizerBase
    from transformers.utils import chat_template_utils

    from tokenmill.server.chat import RESERVED_TEMPLATE_ARGS

    named = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | set(
        inspect.signature(chat_template_utils.render_jinja_template).parameters)
    named |= set(PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES) | {"messages"}
    assert named - {"self", "kwargs"} <= RESERVED_TEMPLATE_ARGS
    root, _ = server
    for name in ("sanitize_control_tokens", "return_assistant_tokens_mask", "conversations", "eos_token",
                 "bos_token", "messages"):
        error = refused(post(root, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {name: True}}),
                        f"chat_template_kwargs.{name}")
        assert "set by the server" in error["message"]
    assert post(root, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
                ).status_code == 200


def test_an_unexpected_failure_names_the_request_not_the_exception(server, monkeypatch, caplog):
    root, state = server
    client = state.fleet.default.ctx.client

    def broken(*args, **kwargs):
        raise RuntimeError("cannot open /secret/checkpoints/model.safetensors")
    monkeypatch.setattr(client._tokenizer, "apply_chat_template", broken)
    r = post(root, "/v1/chat/completions", CHAT)
    rid = r.headers["x-request-id"]
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages", r.text
    assert rid in error["message"] and "secret" not in r.text and "RuntimeError" not in r.text
    assert any(rid in record.getMessage() and record.exc_info for record in caplog.records)
    monkeypatch.undo()
    assert post(root, "/v1/chat/completions", CHAT).headers["x-request-id"] != rid  # one id per request


def test_prompt_logprobs_and_embeddings_are_within_a_byte_budget(server):
    """1 MiB here: 40 prompts of ~30 tokens x n 2 x 21 candidates is over it; the same with 1 candidate is not."""
    root, _ = server
    prompts = [[1000 + i] * 30 for i in range(40)]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 1, "n": 2, "prompt_logprobs": 20}
    error = refused(post(root, "/v1/completions", body), "prompt_logprobs")
    assert "request_output_budget_bytes" in error["message"] and error["code"] == "limit_exceeded"
    assert post(root, "/v1/completions", {**body, "prompt_logprobs": 0}).status_code == 200
    inputs = {"model": "tiny", "input": ["hello"] * 1000}  # 1,000 x 64 dimensions x 24 bytes: over 1 MiB
    refused(post(root, "/v1/embeddings", inputs), "input")
    assert post(root, "/v1/embeddings", {"model": "tiny", "input": ["hello"] * 10}).status_code == 200


def test_a_request_that_fails_in_the_engine_ends_alone(server, monkeypatch):
    """A fault injected into one request's step (its prompt holds a marker token): that request gets a 500 naming its
    request id, never the fault's text; a request beside it in the same steps gets the tokens it gets alone."""
    import asyncio

    from tokenmill.engine.runner import ModelRunner

    root, _ = server
    marker, compute = 4242, ModelRunner.compute

    def faulty(self, scheduled, drafts, bitmasks):
        for request_id in scheduled:
            row = self.batch.row_of[request_id]
            if marker in self.batch.token_ids[row, :self.batch.num_tokens[row]]:
                raise RuntimeError("injected fault at /secret/weights")
        return compute(self, scheduled, drafts, bitmasks)
    normal = {"model": "tiny", "prompt": [100, 200, 300], "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    alone = post(root, "/v1/completions", normal).json()["choices"][0]["text"]
    monkeypatch.setattr(ModelRunner, "compute", faulty)

    async def both(stream: bool):
        async with httpx.AsyncClient(timeout=60, headers=HEADERS) as client:
            bad = {**normal, "prompt": [100, marker, 300], "stream": stream}
            return await asyncio.gather(client.post(root + "/v1/completions", json=bad),
                                        client.post(root + "/v1/completions", json=normal))
    failed, served = asyncio.run(both(False))
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["code"] == "engine_error" and failed.headers["x-request-id"] in error["message"]
    assert "secret" not in failed.text and "injected" not in failed.text
    assert served.json()["choices"][0]["text"] == alone
    streamed, served = asyncio.run(both(True))
    assert streamed.status_code == 200 and '"engine_error"' in streamed.text and "secret" not in streamed.text
    assert served.json()["choices"][0]["text"] == alone
    monkeypatch.undo()
    healthy(root)


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "ab", "max_tokens": 2, "stop": ["x\\udfff\\ud800"]}',
    b'{"model": "tiny\xed\xa0\x80", "prompt": "ab", "max_tokens": 2}'])
def test_lone_surrogates_are_refused_before_any_route_reads_them(server, body):
    """No character, so no tokenizer, log line or response can carry one (they were 500s); a pair is text."""
    root, _ = server
    r = httpx.post(root + "/v1/completions", content=body, headers={**HEADERS, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_text", r.text
    pair = b'{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    assert httpx.post(root + "/v1/completions", content=pair, timeout=30,
                      headers={**HEADERS, "content-type": "application/json"}).status_code == 200


def test_a_submit_the_engine_cannot_read_is_answered_not_fatal():
    """What the API process made but the engine process reads otherwise (a parameter judged differently there) ends
    that request with an error; the engine's loop goes on."""
    import msgspec

    from tokenmill.engine.messages import EngineRequest
    from tokenmill.engine.process import _decode_request
    from tokenmill.sampling.params import SamplingParams

    params = SamplingParams()
    params.top_p = 0.0  # what a subnormal top_p read as in a process that flushes subnormals
    payload = msgspec.msgpack.encode(EngineRequest("r1", [1, 2, 3], params, 4, 0.0))
    answer = _decode_request(msgspec.msgpack.Decoder(EngineRequest), payload)
    assert answer.request_id == "r1" and answer.finish_reason == "error" and answer.error_code == "engine_error"
    assert answer.num_prompt_tokens == 3
    with pytest.raises(msgspec.DecodeError):
        _decode_request(msgspec.msgpack.Decoder(EngineRequest), b"\xc1")  # not even an id: the engine's own fault
