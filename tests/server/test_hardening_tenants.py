"""Tenants that cannot starve or read each other, on a live server (a tiny random Llama with SmolLM2's tokenizer, in
process): capacity that follows the engine rather than the reader, streams that cannot hold the server up, a key's
share taken before any work is done for it, prefix-cache blocks and stored responses private to a key, and the
operator's endpoints behind the key when asked."""

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from tests.live_server import inprocess_server
from tests.server.test_fleet import Loader, host, wait_for
from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill.config import ConfigError
from tokenmill.engine.client import EngineDeadError
from tokenmill.server.auth import load_keys
from tokenmill.server.errors import APIError

KEYS = [{"name": "admin", "key": "sk-admin", "admin": True},
        {"name": "a", "key": "sk-a", "tpm": 10**6},
        {"name": "b", "key": "sk-b"},
        {"name": "c", "key": "sk-c", "cache_group": "team"},
        {"name": "d", "key": "sk-d", "cache_group": "team"},
        {"name": "capped", "key": "sk-capped", "max_concurrent": 2},
        {"name": "slow", "key": "sk-slow", "rpm": 3}]
SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about bread, opening hours and "
          "orders; keep every answer short, friendly and exact, and never invent prices or products. ") * 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp("tenants")
    make_llama_checkpoint(path, smollm_llm)
    return str(path)


def serve(tiny, **settings):
    return inprocess_server(model=tiny, served_model_name="tiny", dtype="float32", kv_cache_memory="16MiB",
                            enforce_eager=True, keys=KEYS, **settings)


@pytest.fixture(scope="module")
def server(tiny):
    with serve(tiny, responses_store_max_bytes="1MiB", responses_store_max_bytes_per_key="256KiB",
               responses_store_max_item_bytes="128KiB") as running:
        yield running


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer sk-{key}"}


def chat(root: str, key: str, body: dict | None = None, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **(body or {}),
            **fields}
    return httpx.post(root + "/v1/chat/completions", json=body, headers=auth(key), timeout=60)


class RawStream:
    """A streamed request on a socket, read only when asked."""

    def __init__(self, root: str, key: str, body: dict):
        host, port = root.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        payload = json.dumps({**body, "stream": True}).encode()
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer sk-" + key.encode() + b"\r\nContent-Length: "
                          + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    def read_all(self, timeout: float = 60) -> str:
        """Everything until the server ends the response or closes the connection."""
        self.sock.settimeout(timeout)
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        self.sock.close()
        return data.decode(errors="replace")


class StalledReader:
    """A streamed request driven through the app's ASGI interface on the server's own event loop, whose client stops
    taking events after the first ``after`` until ``resume()``: a reader as slow as a test needs, whatever the kernel's
    socket buffers would have absorbed."""

    def __init__(self, state, key: str, body: dict, after: int = 3):
        self.state, self.sent = state, []
        self.loop = state.fleet.default.ctx.client._loop  # the server's loop (set by an earlier request)
        assert self.loop is not None
        self._resume: asyncio.Event | None = None
        payload = json.dumps({**body, "stream": True}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
                 "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer sk-{key}".encode()),
                             (b"content-length", str(len(payload)).encode())]}

        async def call() -> None:
            self._resume = asyncio.Event()
            delivered = False

            async def receive() -> dict:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": payload, "more_body": False}
                await asyncio.Event().wait()  # the client never leaves

            async def send(message: dict) -> None:
                if message["type"] == "http.response.body" and len(self.sent) > after:
                    await self._resume.wait()
                self.sent.append(message)
            await state.in_flight(scope, receive, send)
        self.done = asyncio.run_coroutine_threadsafe(call(), self.loop)

    def resume(self) -> None:
        self.loop.call_soon_threadsafe(self._resume.set)

    def text(self, timeout: float = 60) -> str:
        self.done.result(timeout)
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body").decode()


LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me everything."}], "n": 8,
        "max_tokens": 200, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}


def engine_idle(state) -> bool:
    stats = state.fleet.default.ctx.client.stats
    return stats.num_running == 0 and stats.num_waiting == 0


def test_capacity_follows_the_engine_not_the_reader(server):
    """Streams whose clients have stopped reading: once the engine has finished them, their admission promise and their
    key's token charge are back, while their answers still wait to be read (and are then sent whole)."""
    root, state = server
    assert chat(root, "a").status_code == 200
    ctx = state.fleet.default.ctx
    streams = [StalledReader(state, "a", LONG) for _ in range(3)]
    wait_for(lambda: ctx.client.stats.num_running > 0, 30)
    wait_for(lambda: engine_idle(state), 60)
    assert not any(stream.done.done() for stream in streams)  # still unread
    wait_for(lambda: ctx.admission.promised_tokens == 0, 10)
    assert ctx.admission.num_reserved == 0
    remaining = int(state.tenants.headers("a")["x-ratelimit-remaining-tokens"])
    assert remaining >= 10**6 - 3 * 8 * (200 + 40) - 10  # settled to what was used (prompt + 200 outputs a choice)
    for stream in streams:
        stream.resume()
        text = stream.text()
        assert text.count('"finish_reason": "length"') == 8 and "data: [DONE]" in text


@pytest.fixture(scope="module")
def small_buffer(tiny):
    with serve(tiny, stream_buffer_bytes="32KiB", stream_send_timeout_s=120) as running:
        yield running


def test_a_stream_that_falls_too_far_behind_is_cut_off(small_buffer):
    """32 KiB of output may wait for a reader; past it the engine's work is aborted and the stream ends with an error
    event the reader gets when it reads again."""
    root, state = small_buffer
    assert chat(root, "a").status_code == 200
    aborted = state.fleet.default.ctx.client.stats.num_aborted_total
    stream = StalledReader(state, "a", LONG)
    wait_for(lambda: engine_idle(state) and state.fleet.default.ctx.client.stats.num_aborted_total > aborted, 60)
    assert state.fleet.default.ctx.admission.num_reserved == 0
    stream.resume()
    text = stream.text()
    assert '"stream_buffer_exceeded"' in text and "data: [DONE]" in text
    assert text.count('"finish_reason": "length"') < 8  # cut before its end
    assert chat(root, "a").status_code == 200


@pytest.fixture(scope="module")
def short_send_timeout(tiny):
    with serve(tiny, stream_send_timeout_s=1.0) as running:
        yield running


def test_a_stream_that_cannot_be_written_is_closed(short_send_timeout, caplog):
    """A send that waits a second (the setting here) closes the stream and aborts what the engine still runs."""
    root, state = short_send_timeout
    assert chat(root, "a").status_code == 200
    aborted = state.fleet.default.ctx.client.stats.num_aborted_total
    stream = StalledReader(state, "a", {**LONG, "logprobs": False, "top_logprobs": None})
    started = time.monotonic()
    stream.done.result(30)  # the response ended by itself, its client never having resumed
    assert time.monotonic() - started < 20
    assert "data: [DONE]" not in stream.text()
    assert any("stream closed" in r.getMessage() for r in caplog.records)
    wait_for(lambda: engine_idle(state) and state.fleet.default.ctx.client.stats.num_aborted_total > aborted, 30)
    assert state.fleet.default.ctx.admission.num_reserved == 0


def test_a_keys_requests_at_once_are_capped(server):
    root, state = server
    held = [RawStream(root, "capped", LONG) for _ in range(2)]
    wait_for(lambda: state.tenants._of("capped").open == 2, 30)
    refused = chat(root, "capped")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert chat(root, "b").status_code == 200  # another key is not held up
    held[0].read_all()
    wait_for(lambda: state.tenants._of("capped").open == 1, 30)
    assert chat(root, "capped").status_code == 200
    held[1].read_all()


def test_refused_requests_count_and_no_work_is_done_past_the_rate(server, monkeypatch):
    """rpm 3: three requests that end in a 400 use the key's three; the fourth is a 429 before its template renders."""
    root, state = server
    client, rendered = state.fleet.default.ctx.client, []
    render = client._tokenizer.apply_chat_template
    monkeypatch.setattr(client._tokenizer, "apply_chat_template", lambda *a, **k: rendered.append(1) or render(*a, **k))
    for _ in range(3):
        assert chat(root, "slow", chat_template_kwargs={"eos_token": "x"}).status_code == 400
    before = len(rendered)
    refused = chat(root, "slow")
    assert refused.status_code == 429 and "RPM" in refused.json()["error"]["message"]
    assert len(rendered) == before and int(refused.headers["retry-after"]) >= 1


@pytest.mark.parametrize("where", ["tokenizer", "grammar"])
def test_a_keys_many_requests_do_not_hold_up_anothers(server, monkeypatch, where):
    """Key a queues eight requests' preparation; key b's one runs right after the one in progress, not after all of
    them (the prepare threads are served round-robin by key)."""
    root, state = server
    client = state.fleet.default.ctx.client
    if where == "tokenizer":
        encode = client._tokenizer.encode
        monkeypatch.setattr(client._tokenizer, "encode", lambda *a, **k: time.sleep(0.3) or encode(*a, **k))
    else:  # the grammar checks' two threads
        from tokenmill.structured.checker import GrammarChecker
        monkeypatch.setattr(GrammarChecker, "check", lambda self, spec: time.sleep(0.6))
    done: list[str] = []

    async def one(client_: httpx.AsyncClient, key: str, i: int) -> None:
        if where == "tokenizer":
            r = await client_.post(root + "/tokenize", headers=auth(key), json={"model": "tiny", "prompt": f"x{i}"})
        else:
            r = await client_.post(root + "/v1/completions", headers=auth(key), json={
                "model": "tiny", "prompt": "Hi", "max_tokens": 1, "structured_outputs": {"regex": f"a{{{i}}}"}})
        assert r.status_code == 200, r.text
        done.append(key)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client_:
            first = [asyncio.create_task(one(client_, "a", i)) for i in range(8)]
            await asyncio.sleep(0.2)  # a's are queued
            await asyncio.gather(one(client_, "b", 0), *first)
    asyncio.run(run())
    assert done.index("b") <= 3, done  # round-robin: at most the workers' jobs in progress, and one more of a's


def usage_cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prefix_cache_blocks_are_private_to_a_key_unless_keys_share_a_group(server):
    root, _ = server
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Open on Sunday?"}]}
    assert usage_cached(chat(root, "a", body)) == 0
    assert usage_cached(chat(root, "a", body)) >= 64  # its own blocks, reused
    assert usage_cached(chat(root, "b", body)) == 0  # the probe: b learns nothing of a's prompt
    for salt in ("x", None):
        assert usage_cached(chat(root, "b", body, cache_salt=salt)) in (0, usage_cached(chat(root, "b", body)))
    assert usage_cached(chat(root, "c", body)) == 0
    assert usage_cached(chat(root, "d", body)) >= 64  # one team: shared


def test_stored_responses_of_one_key_survive_anothers_flood(server):
    """The issue's probe: the admin stores a response, a tenant then stores many with large input items; the admin's
    is still there. An item larger than the store keeps is refused when it asks to be stored."""
    root, _ = server
    stored = httpx.post(root + "/v1/responses", headers=auth("admin"), timeout=60,
                        json={"model": "tiny", "input": "Hello", "max_output_tokens": 3})
    assert stored.status_code == 200, stored.text
    big = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "z" * 100_000}]}
    for _ in range(17):
        r = httpx.post(root + "/v1/responses", headers=auth("b"), timeout=60, json={
            "model": "tiny", "input": [big, {"role": "user", "content": "Hi"}], "max_output_tokens": 2})
        assert r.status_code == 200, r.text
    assert httpx.get(root + f"/v1/responses/{stored.json()['id']}", headers=auth("admin")).status_code == 200
    huge = {**big, "content": [{"type": "reasoning_text", "text": "z" * 200_000}]}
    refused = httpx.post(root + "/v1/responses", headers=auth("b"), timeout=60, json={
        "model": "tiny", "input": [huge, {"role": "user", "content": "Hi"}], "max_output_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
    unstored = httpx.post(root + "/v1/responses", headers=auth("b"), timeout=60, json={
        "model": "tiny", "input": [huge, {"role": "user", "content": "Hi"}], "max_output_tokens": 2, "store": False})
    assert unstored.status_code == 200


def test_metrics_name_no_key_unless_asked(server):
    root, _ = server
    assert chat(root, "b").status_code == 200
    text = httpx.get(root + "/metrics").text
    assert "key_name" not in text and 'key_name="b"' not in text


@pytest.fixture(scope="module")
def locked(tiny):
    with serve(tiny, auth_all_endpoints=True, metrics_per_key=True) as running:
        yield running


def test_every_per_model_series_is_exported_from_start_up(locked):
    """Before any request: the counters and histograms the dashboard's cost and latency panels read are there at 0."""
    root, _ = locked
    text = httpx.get(root + "/metrics", headers=auth("admin")).text
    for series in ("generation_tokens_total", "prompt_tokens_total", "engine_seconds_total",
                   "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                   "e2e_request_latency_seconds_count"):
        assert re.search(rf'^tokenmill:{series}\{{model_name="tiny"\}} 0\.0$', text, re.M), series


def test_operator_endpoints_need_a_key_when_asked_and_keys_appear_when_asked(locked):
    root, _ = locked
    for path in ("/metrics", "/openapi.json", "/docs", "/redoc", "/health", "/ready"):
        assert httpx.get(root + path).status_code == 401, path
        assert httpx.get(root + path, headers=auth("b")).status_code == 200, path
    assert chat(root, "b").status_code == 200
    assert 'key_name="b"' in httpx.get(root + "/metrics", headers=auth("b")).text


def test_two_keys_of_one_name_are_refused_at_start(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("team: sk-one\nteam: sk-two\n")
    with pytest.raises(ConfigError, match="'team' is given twice"):
        load_keys([], str(keys))
    keys.write_text("key-1: sk-one\n")  # the name --api-key's first key takes
    with pytest.raises(ConfigError, match="given twice"):
        load_keys(["sk-zero"], str(keys))


def test_failures_reach_tenants_as_their_kind_not_their_text():
    """A model that failed to load, and an engine that died mid-request: the 503 and the 500 say what happened and
    name the request, never the exception's text (paths, devices)."""
    failing = host(loader=Loader(fail=1))
    failing.load()
    wait_for(lambda: failing.status == "failed")
    with pytest.raises(APIError) as refused:
        failing.context()
    assert refused.value.status == 503 and "no such weights" not in refused.value.message

    from tokenmill.server.tracker import Tracker

    class DeadClient:
        async def generate(self, request):
            raise EngineDeadError("CUDA error: an illegal memory access at /secret/model.bin")
            yield

    class Ctx:
        client = DeadClient()

    class Held:
        def release(self):
            pass

    class Request:
        request_id, prompt_token_ids = "r", [1]

    async def consume():
        tracker = Tracker(Ctx(), "chat", 0.0, None, [Request()], Held())
        tracker._release = lambda: None  # the context's accounting is not what is tested here
        async for _ in tracker.outputs():
            pass
    with pytest.raises(APIError) as failed:
        asyncio.run(consume())
    assert failed.value.status == 500 and failed.value.code == "engine_failed"
    assert "secret" not in failed.value.message and "CUDA" not in failed.value.message

