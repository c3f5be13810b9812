"""Keys as tenants (the ``[[keys]]`` of the config, tokenmill/key_policy.py): which models a key may use, its request
and token rates, and how many of its requests may be open at once.

Rates are token buckets, as OpenAI's limits behave: a bucket holds up to ``limit`` (per minute) and refills at
``limit / 60`` a second, starting full. Charged before any work is done for the request:
- at the edge (``enter``, server/edge.py), before its body is read: one from the key's request bucket, provided its
  token bucket is not empty and fewer than ``max_concurrent`` of its requests are open (``leave`` when the response
  is over). A request refused later (a 400, say) has still used its request.
- once its promise is known (``charge``: prompt + max_tokens over every choice), before admission: the promise from
  the token bucket, settled to the tokens really used when the engine is done with it (the difference goes back).
A request that does not fit is a 429 with ``Retry-After`` (whole seconds until the buckets hold enough); one whose
promise is more than the token bucket can ever hold is a 429 that says so. Every response to a key with limits
carries OpenAI's headers (``x-ratelimit-limit|remaining|reset-requests|tokens``), read when the response starts
(server/app.py).

Invariant: a Charge is taken once (``Tenants.charge``) and settled once, by the request's Tracker (server/tracker.py)
when the engine is done with the request, however it ended; a request that ``enter``ed ``leave``s once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from tokenmill.config import KeyPolicy
from tokenmill.engine.messages import BATCH, INTERACTIVE
from tokenmill.server.errors import APIError


class TokenBucket:
    def __init__(self, per_minute: int, clock: Callable[[], float]):
        self.limit, self.rate, self.clock = per_minute, per_minute / 60.0, clock
        self._level, self._at = float(per_minute), clock()

    def level(self) -> float:
        now = self.clock()
        self._level = min(self.limit, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` fits (0 if it does now)."""
        return max(0.0, (amount - self.level()) / self.rate)

    def take(self, amount: float) -> None:
        self.level()
        self._level -= amount

    def give_back(self, amount: float) -> None:
        self._level = min(self.limit, self.level() + amount)

    def reset_after(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.limit - self.level()) / self.rate


def duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 100) / 100:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass
class Charge:
    """One request's draw on its key's buckets; ``settle`` gives back the tokens the request did not use (once),
    ``refund`` everything it took (a request the server refused for its own lack of capacity)."""
    bucket: TokenBucket | None
    tokens: int
    settled: bool = False
    request_bucket: TokenBucket | None = None

    def settle(self, used_tokens: int) -> None:
        if not self.settled:
            self.settled = True
            if self.bucket is not None and used_tokens < self.tokens:
                self.bucket.give_back(self.tokens - used_tokens)

    def refund(self) -> None:
        if not self.settled and self.request_bucket is not None:
            self.request_bucket.give_back(1)
        self.settle(0)


NO_CHARGE = Charge(None, 0, settled=True)


class KeyLimits:
    def __init__(self, policy: KeyPolicy, clock: Callable[[], float]):
        self.policy = policy
        self.requests = TokenBucket(policy.rpm, clock) if policy.rpm else None
        self.tokens = TokenBucket(policy.tpm, clock) if policy.tpm else None
        self.open = 0  # requests that entered and have not left

    def enter(self) -> None:
        """Take one request (a 429 saying which limit when it does not fit), and count it open until ``leave``."""
        name, cap = self.policy.name, self.policy.max_concurrent
        if cap is not None and self.open >= cap:
            raise APIError(429, f"Too many requests at once for key {name!r}: its limit is {cap} open requests. "
                                "Retry when one has finished.", "requests", code="concurrency_limit_exceeded",
                           headers={**self.headers(), "Retry-After": "1"})
        self._wait({"requests per minute (RPM)": self.requests.wait_for(1) if self.requests else 0.0,
                    "tokens per minute (TPM)": self.tokens.wait_for(1) if self.tokens else 0.0})
        if self.requests is not None:
            self.requests.take(1)
        self.open += 1

    def _wait(self, waits: dict[str, float]) -> None:
        limit, wait = max(waits.items(), key=lambda item: item[1])
        if wait > 0:
            retry_after = str(math.ceil(wait - 1e-6))  # whole seconds (a float's last bit never adds one)
            raise APIError(429, f"Rate limit reached for key {self.policy.name!r} on {limit}. Please try again in "
                                f"{duration(wait)}.", "requests" if "RPM" in limit else "tokens",
                           code="rate_limit_exceeded", headers={**self.headers(), "Retry-After": retry_after})

    def headers(self) -> dict[str, str]:
        out = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(bucket.limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level())))
                out[f"x-ratelimit-reset-{kind}"] = duration(bucket.reset_after())
        return out

    def charge(self, tokens: int) -> Charge:
        """Take ``tokens`` (the request's promise) from the token bucket, or raise the 429 that says when. The request
        itself was taken at the edge (``enter``); the Charge can give it back (``refund``)."""
        name = self.policy.name
        if self.tokens is not None and tokens > self.tokens.limit:
            raise APIError(429, f"Request too large for key {name!r}: {tokens} tokens requested (prompt + "
                                f"max_tokens), its limit is {self.tokens.limit} tokens per minute. Lower max_tokens "
                                "or the prompt.", "tokens", code="rate_limit_exceeded", headers=self.headers())
        self._wait({"tokens per minute (TPM)": self.tokens.wait_for(tokens) if self.tokens else 0.0})
        if self.tokens is not None:
            self.tokens.take(tokens)
        return Charge(self.tokens, tokens if self.tokens is not None else 0, request_bucket=self.requests)


class Tenants:
    """The server's key policies by key name (a key without a policy: any model, no limits)."""

    def __init__(self, policies: list[KeyPolicy], clock: Callable[[], float] = time.monotonic):
        self._limits = {p.name: KeyLimits(p, clock) for p in policies}

    def _of(self, key_name: str | None) -> KeyLimits | None:
        return self._limits.get(key_name) if key_name else None

    def may_use(self, key_name: str | None, model: str) -> bool:
        limits = self._of(key_name)
        return limits is None or limits.policy.models is None or model in limits.policy.models

    def is_admin(self, key_name: str | None) -> bool:
        limits = self._of(key_name)
        return limits is not None and limits.policy.admin

    def check_model(self, key_name: str | None, model: str) -> None:
        """A 404 for a model this key may not use, worded as OpenAI words a model it does not know."""
        if not self.may_use(key_name, model):
            raise APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                           "invalid_request_error", param="model", code="model_not_found")

    def enter(self, key_name: str | None) -> None:
        """At the edge, before any work for the request (see the module docstring)."""
        limits = self._of(key_name)
        if limits is not None:
            limits.enter()

    def leave(self, key_name: str | None) -> None:
        limits = self._of(key_name)
        if limits is not None:
            limits.open -= 1

    def charge(self, key_name: str | None, tokens: int) -> Charge:
        limits = self._of(key_name)
        return limits.charge(tokens) if limits is not None else NO_CHARGE

    def cache_scope(self, key_name: str | None) -> str | None:
        """Whose prefix-cache blocks a request of this key may share: its ``cache_group``'s, else its own; None
        (everybody's) on a server without keys."""
        if key_name is None:
            return None
        limits = self._of(key_name)
        group = limits.policy.cache_group if limits is not None else None
        return f"group:{group}" if group else f"key:{key_name}"

    def priority(self, key_name: str | None, service_tier: str | None) -> int:
        """The scheduling priority of a request (scheduler/priority.py): batch for a batch key, or when the request
        asks for OpenAI's ``service_tier: "flex"``; interactive otherwise (a batch key cannot ask for more)."""
        limits = self._of(key_name)
        batch = service_tier == "flex" or (limits is not None and limits.policy.priority == "batch")
        return BATCH if batch else INTERACTIVE

    def headers(self, key_name: str | None) -> dict[str, str]:
        limits = self._of(key_name)
        return limits.headers() if limits is not None else {}
