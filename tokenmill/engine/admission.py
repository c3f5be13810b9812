"""Admission control on the API side: the token *promise* (prompt + max_tokens) of every admitted request that has
not ended is reserved; a request whose promise would push the total past ``limit`` is refused (429), so overload is a
fast, explicit answer instead of an unbounded queue. An idle server admits anything that passed validation, so no
single valid request is refused forever.

Retry-After: how long until the refused promise would fit, at the rate promises have been draining (released
tokens over the last ``window`` seconds); 1 s before anything has drained, at most ``max_retry_after`` s.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable


class Admission:
    def __init__(self, limit: int, window: float = 30.0, max_retry_after: int = 60,
                 clock: Callable[[], float] = time.monotonic):
        self.limit, self.window, self.max_retry_after, self.clock = limit, window, max_retry_after, clock
        self.promised_tokens = 0
        self._promises: dict[str, int] = {}  # request id -> reserved tokens
        self._released: deque[tuple[float, int]] = deque()  # (time, tokens) within the window
        self._since = clock()  # start of the drain measurement (the window, or less just after start-up)

    def reserve(self, promises: dict[str, int]) -> bool:
        """Admit these requests (id -> promise) together if their promise fits, reserving it."""
        total = sum(promises.values())
        if self._promises and self.promised_tokens + total > self.limit:
            return False
        self._promises.update(promises)
        self.promised_tokens += total
        return True

    def release(self, request_ids: list[str]) -> None:
        """Give back reservations (idempotent: a request's own end already released it)."""
        now = self.clock()
        for rid in request_ids:
            tokens = self._promises.pop(rid, 0)
            if tokens:
                self.promised_tokens -= tokens
                self._released.append((now, tokens))

    def drain_rate(self) -> float:
        """Promised tokens released per second over the last ``window`` seconds."""
        now = self.clock()
        while self._released and self._released[0][0] < now - self.window:
            self._released.popleft()
        span = min(self.window, now - self._since)
        return sum(t for _, t in self._released) / span if span > 0 else 0.0

    def retry_after(self, promise: int) -> int:
        """Whole seconds until ``promise`` would fit at the current drain rate."""
        excess = self.promised_tokens + promise - self.limit
        rate = self.drain_rate()
        if excess <= 0 or rate <= 0:
            return 1
        return max(1, min(self.max_retry_after, math.ceil(excess / rate)))
