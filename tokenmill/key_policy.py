"""API keys as tenants: the ``[[keys]]`` entries of the TOML config (EngineConfig.keys), pure data. server/tenants.py
enforces them (which models a key may use, its request and token rates); server/auth.py recognizes the keys.

    [[keys]]
    name = "team-a"                 # what logs, metrics and errors show; never the key itself
    key_sha256 = "9f86d08..."       # or key = "sk-..." (the sha256 keeps the secret out of the file)
    models = ["SmolLM2-135M-Instruct"]   # omitted: every model
    rpm = 60                        # requests per minute (omitted: no limit)
    tpm = 20000                     # tokens per minute: prompt + max_tokens promised, settled to the tokens used
    priority = "interactive"        # or "batch": runs on the capacity interactive work leaves
    admin = false                   # true: may read every key's usage at GET /v1/usage
    max_concurrent = 8              # most requests open at once (omitted: no limit); beyond it a 429
    cache_group = "team-a"          # keys of one group share prefix-cache blocks (omitted: the key's own name)
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class KeyPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    key: str | None = Field(None, min_length=1, repr=False)
    key_sha256: str | None = None
    models: tuple[str, ...] | None = None
    rpm: int | None = Field(None, gt=0)
    tpm: int | None = Field(None, gt=0)
    priority: Literal["interactive", "batch"] = "interactive"
    admin: bool = False  # may read every key's usage (GET /v1/usage); other keys read their own
    max_concurrent: int | None = Field(None, gt=0)  # requests open at once (server/tenants.py)
    # Prefix-cache blocks are private to a key unless keys name a common group (server/serving.py cache_scope).
    cache_group: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_secret(self) -> "KeyPolicy":
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"key {self.name!r}: give exactly one of key and key_sha256")
        if self.key_sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", self.key_sha256):
            raise ValueError(f"key {self.name!r}: key_sha256 must be 64 hexadecimal digits")
        return self

    @property
    def digest(self) -> str:
        """The key's sha256, lower-case hex: how the key is compared, whichever way the file gave it."""
        return (self.key_sha256 or hashlib.sha256(self.key.encode()).hexdigest()).lower()


def check_unique(policies: list[KeyPolicy]) -> None:
    """ValueError where two entries share a name or a key."""
    for attribute, what in (("name", "name"), ("digest", "key")):
        seen: set[str] = set()
        for policy in policies:
            value = getattr(policy, attribute)
            if value in seen:
                raise ValueError(f"keys: two entries share the {what} of {policy.name!r}")
            seen.add(value)
