"""The server and its engine in this test process (--no-engine-process, uvicorn on a thread), so that a test can
watch the objects themselves: an admission reservation is released exactly once however the response ends, and an
error the engine reports mid-request (a grammar over its budget) reaches the client as a 400 naming the field, or as
an error event in a stream that has started."""

import asyncio
import time

import httpx
import pytest

from tests.live_server import MODEL, inprocess_server
from tokenmill.server.admission import Reservation
from tokenmill.structured.checker import GrammarChecker
from tokenmill.structured.matchers import GrammarMatchers


@pytest.fixture(scope="module")
def inprocess():
    with inprocess_server(dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="64MiB", max_model_len=1024,
                          grammar_timeout=1.0) as running:
        yield running


@pytest.fixture
def releases(monkeypatch):
    """Every Reservation.release call, by reservation."""
    calls: list[Reservation] = []
    release = Reservation.release

    def counted(self):
        calls.append(self)
        release(self)
    monkeypatch.setattr(Reservation, "release", counted)
    return calls


def settled(state, seconds: float = 30.0) -> None:
    """Until the engine runs nothing and no promise is reserved."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if state.ctx.admission.num_reserved == 0 and state.ctx.client.stats.num_running == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the request never ended")


LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}


def test_a_reservation_is_released_once_when_a_stream_is_left(inprocess, releases):
    root, state = inprocess
    with httpx.stream("POST", root + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                assert state.ctx.admission.promised_tokens > 0
                break  # the client leaves mid-stream
    settled(state)
    assert len(releases) == 1 and state.ctx.admission.promised_tokens == 0


def test_a_reservation_is_released_once_when_a_waiting_client_leaves(inprocess, releases):
    root, state = inprocess

    async def leave():
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.ensure_future(client.post(root + "/v1/completions", json={**LONG, "n": 2}))
            deadline = time.monotonic() + 30
            while state.ctx.client.stats.num_running < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            task.cancel()  # the connection closes before any byte of the answer
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(leave())
    settled(state)
    assert len(releases) == 1 and state.ctx.admission.promised_tokens == 0


def test_a_reservation_is_released_once_for_a_finished_request(inprocess, releases):
    root, state = inprocess
    for stream in (False, True):
        r = httpx.post(root + "/v1/completions", json={**LONG, "max_tokens": 4, "stream": stream}, timeout=60)
        assert r.status_code == 200
    settled(state)
    assert len(releases) == 2 and len({id(r) for r in releases}) == 2


def test_an_engine_side_grammar_error_is_a_400_or_an_error_event(inprocess, monkeypatch):
    """A grammar that passed the API's check but whose work in the engine runs past grammar_timeout (1 s here; the
    matcher is slowed after three tokens, as a pathological grammar slows down) ends only its own request."""
    root, state = inprocess
    monkeypatch.setattr(GrammarChecker, "check", lambda self, spec: None)
    accept, seen = GrammarMatchers.accept, {}

    def slow_after_three(self, request_id, tokens):
        if len(seen.setdefault(request_id, [])) >= 3:
            time.sleep(1.5)
        seen[request_id].extend(tokens)
        return accept(self, request_id, tokens)
    monkeypatch.setattr(GrammarMatchers, "accept", slow_after_three)
    body = {"model": MODEL, "prompt": "Say z:", "max_tokens": 100, "structured_outputs": {"regex": "z{1,90}"}}
    normal = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    alone = httpx.post(root + "/v1/completions", json=normal, timeout=60).json()["choices"][0]["text"]

    async def both():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(client.post(root + "/v1/completions", json=body),
                                        client.post(root + "/v1/completions", json=normal))
    refused, served = asyncio.run(both())
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "structured_outputs.regex" and "grammar_timeout" in error["message"]
    assert served.json()["choices"][0]["text"] == alone
    with httpx.stream("POST", root + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and '"structured_outputs.regex"' in data[-2] and '"error"' in data[-2]
    settled(state)
