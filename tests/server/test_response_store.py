"""The bounded response store: by count and by bytes, least recently used first, each key's responses its own."""

import json

from tokenmill.server.response_store import ResponseStore


def _response(n: int, text: str = "") -> dict:
    return {"id": f"resp_{n}", "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def _size(response: dict, items: list) -> int:
    return len(json.dumps(response)) + len(json.dumps(items))


def test_the_count_bound_drops_the_least_recently_used():
    store = ResponseStore(max_count=2, max_bytes=10**6)
    for n in range(2):
        assert store.put("team-a", _response(n), [])
    assert store.get("team-a", "resp_0") is not None  # now resp_1 is the least recently used
    store.put("team-a", _response(2), [])
    assert store.get("team-a", "resp_1") is None and store.get("team-a", "resp_0") is not None
    assert len(store) == 2 and store.bytes == sum(_size(_response(n), []) for n in (0, 2))


def test_the_byte_bound_and_a_response_too_large_alone():
    one = _size(_response(0, "x" * 100), [])
    store = ResponseStore(max_count=100, max_bytes=2 * one + 10)
    for n in range(3):
        assert store.put(None, _response(n, "x" * 100), [])
    assert [store.get(None, f"resp_{n}") is not None for n in range(3)] == [False, True, True]
    assert store.bytes == 2 * one <= store.max_bytes
    assert not store.put(None, _response(9, "x" * 1000), [])  # larger than the whole store: not kept
    assert store.get(None, "resp_9") is None and store.bytes == 2 * one


def test_keys_see_only_their_own_and_delete():
    store = ResponseStore(max_count=10, max_bytes=10**6)
    store.put("team-a", _response(0), [{"type": "message", "role": "user", "content": "hi"}])
    assert store.get("team-b", "resp_0") is None and store.get(None, "resp_0") is None
    assert store.get("team-a", "resp_0").input_items[0]["content"] == "hi"
    assert not store.delete("team-b", "resp_0") and store.delete("team-a", "resp_0")
    assert store.get("team-a", "resp_0") is None and store.bytes == 0 and len(store) == 0


def test_a_zero_store_keeps_nothing():
    store = ResponseStore(max_count=0, max_bytes=10**6)
    assert not store.put(None, _response(0), []) and len(store) == 0
