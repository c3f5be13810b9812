"""The responses /v1/responses keeps (``store``: true, OpenAI's default) for ``previous_response_id`` and
GET/DELETE /v1/responses/{id}: in memory, bounded by count and by bytes (the oldest used goes first), and scoped to the
API key that created each one (another key's id is a miss: a 404, as for an id never seen)."""

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


class ResponseStore:
    """Invariant: ``bytes`` is the sum of the entries' sizes, at most ``max_bytes``, and there are at most
    ``max_count`` entries; a response larger than ``max_bytes`` alone is not kept."""

    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()  # handlers run on the event loop, but a store must not depend on it

    def put(self, key_name: str | None, response: dict[str, Any], input_items: list[dict[str, Any]]) -> bool:
        """Keep a response (True), unless it alone is over the byte bound (False)."""
        size = len(json.dumps(response)) + len(json.dumps(input_items))
        if size > self.max_bytes or self.max_count == 0:
            return False
        with self._lock:
            self._drop((key_name, response["id"]))
            self._entries[(key_name, response["id"])] = StoredResponse(response, input_items, size)
            self.bytes += size
            while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, key_name: str | None, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get((key_name, response_id))
            if entry is not None:
                self._entries.move_to_end((key_name, response_id))
            return entry

    def delete(self, key_name: str | None, response_id: str) -> bool:
        with self._lock:
            return self._drop((key_name, response_id))

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: tuple[str | None, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
