"""Admission control on the API side: the token *promise* (prompt + max_tokens, over every choice) of each admitted
HTTP request is reserved until that request ends; one whose promise would push the total past ``limit`` is refused
(429), so overload is a fast, explicit answer instead of an unbounded queue. An idle server admits anything that passed
validation, so no single valid request is refused forever.

A ``Reservation`` is taken once (``reserve``) and released once, by its owner: the request's Tracker
(server/serving.py), when the response is over, however it ended (finished, failed, or the client left).

Batch requests (a batch key, or ``service_tier: "flex"``) are admitted only while all promises stay within half the
limit, so they are refused first and interactive requests keep the rest.

Retry-After: how long until the refused promise would fit, at the rate promises have been draining (released
tokens over the last ``window`` seconds); 1 s before anything has drained, at most ``max_retry_after`` s.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable


BATCH_SHARE = 0.5  # of the limit, batch promises may fill: with the default 2x overcommit, the KV cache's own size


class Reservation:
    def __init__(self, admission: "Admission", tokens: int):
        self.admission, self.tokens = admission, tokens
        self.released = False

    def release(self) -> None:
        """Give the promise back (a second call changes nothing)."""
        if not self.released:
            self.released = True
            self.admission._give_back(self.tokens)


class Admission:
    def __init__(self, limit: int, window: float = 30.0, max_retry_after: int = 60,
                 clock: Callable[[], float] = time.monotonic, kv_tokens: Callable[[int], int] = lambda n: n):
        self.limit, self.window, self.max_retry_after, self.clock = limit, window, max_retry_after, clock
        # What a request of n tokens holds of the KV cache (EngineInfo.kv_tokens_held: fewer with sliding windows).
        self.kv_tokens = kv_tokens
        self.promised_tokens = 0
        self.num_reserved = 0  # reservations not yet released
        self._released: deque[tuple[float, int]] = deque()  # (time, tokens) within the window
        self._since = clock()  # start of the drain measurement (the window, or less just after start-up)

    @property
    def saturation(self) -> float:
        """Promised tokens over the limit: 1.0 means new requests are being refused."""
        return self.promised_tokens / self.limit if self.limit else 0.0

    def reserve(self, tokens: int, batch: bool = False) -> Reservation | None:
        """Admit a promise of ``tokens`` if it fits (always, when nothing else is reserved); None if not. Batch work
        (scheduler/priority.py) is refused first: it fits only within ``BATCH_SHARE`` of the limit, so interactive
        requests keep the rest."""
        limit = self.limit * BATCH_SHARE if batch else self.limit
        if self.num_reserved and self.promised_tokens + tokens > limit:
            return None
        self.promised_tokens += tokens
        self.num_reserved += 1
        return Reservation(self, tokens)

    def _give_back(self, tokens: int) -> None:
        self.promised_tokens -= tokens
        self.num_reserved -= 1
        if tokens:
            self._released.append((self.clock(), tokens))

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
