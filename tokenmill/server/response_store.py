"""The responses /v1/responses keeps (``store``: true, OpenAI's default) for ``previous_response_id`` and
GET/DELETE /v1/responses/{id}: in memory, scoped to the API key that created each one (another key's id is a miss: a
404, as for an id never seen), and bounded so that no key can push out another's:
- a response (with its conversation) over ``max_item_bytes`` is not kept (server/responses.py refuses to store one
  whose input alone is over it);
- a key holds at most ``max_count_per_key`` responses and ``max_bytes_per_key`` bytes: past them its own least
  recently used go first;
- the server holds at most ``max_count`` and ``max_bytes``: past them the key holding the most bytes gives way (its
  least recently used first), so a key within its fair share keeps what it stored.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    input_items: list[dict[str, Any]]  # the whole conversation before its output (previous responses' included)
    size: int  # bytes of both as JSON


@dataclass
class _Shelf:
    """One key's responses, least recently used first; ``bytes`` is the sum of their sizes."""
    entries: OrderedDict[str, StoredResponse]
    bytes: int = 0


def stored_size(response: dict[str, Any], input_items: list[dict[str, Any]]) -> int:
    return len(json.dumps(response)) + len(json.dumps(input_items))


class ResponseStore:
    """Invariants: each shelf's ``bytes`` is the sum of its entries' sizes, ``bytes`` and ``count`` the sums over the
    shelves, all within the bounds above; an empty shelf is dropped."""

    def __init__(self, max_count: int, max_bytes: int, max_count_per_key: int | None = None,
                 max_bytes_per_key: int | None = None, max_item_bytes: int | None = None):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.max_count_per_key = max_count if max_count_per_key is None else max_count_per_key
        self.max_bytes_per_key = max_bytes if max_bytes_per_key is None else max_bytes_per_key
        self.max_item_bytes = max_bytes if max_item_bytes is None else min(max_item_bytes, max_bytes)
        self._shelves: dict[str | None, _Shelf] = {}
        self.bytes = self.count = 0
        self._lock = threading.Lock()  # handlers run on the event loop, but a store must not depend on it

    def put(self, key_name: str | None, response: dict[str, Any], input_items: list[dict[str, Any]]) -> bool:
        """Keep a response (True), unless it is over the item bound or the store keeps nothing (False)."""
        size = stored_size(response, input_items)
        if size > min(self.max_item_bytes, self.max_bytes_per_key) or not self.max_count or \
                not self.max_count_per_key:
            return False
        with self._lock:
            self._drop(key_name, response["id"])
            shelf = self._shelves.setdefault(key_name, _Shelf(OrderedDict()))
            shelf.entries[response["id"]] = StoredResponse(response, input_items, size)
            shelf.bytes += size
            self.bytes += size
            self.count += 1
            while len(shelf.entries) > self.max_count_per_key or shelf.bytes > self.max_bytes_per_key:
                self._drop(key_name, next(iter(shelf.entries)))
            while self.count > self.max_count or self.bytes > self.max_bytes:
                largest = max(self._shelves, key=lambda k: self._shelves[k].bytes)
                self._drop(largest, next(iter(self._shelves[largest].entries)))
        return True

    def get(self, key_name: str | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            shelf = self._shelves.get(key_name)
            entry = shelf.entries.get(response_id) if shelf is not None else None
            if entry is not None:
                shelf.entries.move_to_end(response_id)
            return entry

    def delete(self, key_name: str | None, response_id: str) -> bool:
        with self._lock:
            return self._drop(key_name, response_id)

    def __len__(self) -> int:
        return self.count

    def _drop(self, key_name: str | None, response_id: str) -> bool:
        shelf = self._shelves.get(key_name)
        entry = shelf.entries.pop(response_id, None) if shelf is not None else None
        if entry is None:
            return False
        shelf.bytes -= entry.size
        self.bytes -= entry.size
        self.count -= 1
        if not shelf.entries:
            del self._shelves[key_name]
        return True
