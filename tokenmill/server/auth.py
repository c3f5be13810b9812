"""API keys: ``--api-key`` (repeatable; named key-1, key-2, ...), ``--api-key-file`` ('name: key' lines) and the
``[[keys]]`` tenants of the config (a key or its sha256; tokenmill/key_policy.py).
Only a key's *name* ever reaches logs and metrics."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.server.errors import APIError


def load_keys(keys: list[str], key_file: str | None) -> dict[str, str]:
    """key -> name."""
    named = {key: f"key-{i + 1}" for i, key in enumerate(keys)}
    if key_file:
        for lineno, line in enumerate(Path(key_file).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, key = line.partition(":")
            if not sep or not name.strip() or not key.strip():
                raise ValueError(f"{key_file}:{lineno}: expected 'name: key'")
            name, key = name.strip(), key.strip()
            if key in named:
                raise ConfigError(f"{key_file}:{lineno}: this key is given twice")
            if name in named.values():  # two keys of one name would be one tenant: their limits and usage merged
                raise ConfigError(f"{key_file}:{lineno}: the key name {name!r} is given twice")
            named[key] = name
    return named


class Authenticator:
    def __init__(self, keys: dict[str, str], digests: dict[str, str] | None = None):
        """``keys``: key -> name; ``digests``: a key's sha256 (lower-case hex) -> name (the ``[[keys]]`` tenants)."""
        self.keys, self.digests = keys, digests or {}
        clash = set(keys.values()) & set(self.digests.values())
        if clash:
            raise ConfigError(f"key names given twice (--api-key / --api-key-file and [[keys]]): {sorted(clash)}")

    def check(self, authorization: str | None, x_api_key: str | None = None) -> str | None:
        """The caller's key name (None when auth is off) from ``Authorization: Bearer KEY`` or (Anthropic's clients)
        ``x-api-key: KEY``; raises a 401 APIError for a missing or wrong key."""
        if not self.keys and not self.digests:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        offered = [t for t in (token.strip() if scheme.lower() == "bearer" else None, x_api_key) if t]
        for candidate in offered:
            for key, name in self.keys.items():
                if hmac.compare_digest(candidate.encode(), key.encode()):
                    return name
            digest = hashlib.sha256(candidate.encode()).hexdigest()
            for known, name in self.digests.items():
                if hmac.compare_digest(digest, known):
                    return name
        raise APIError(401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")


def authenticator_for(config: EngineConfig) -> Authenticator:
    """Every key the config names: --api-key, --api-key-file and the [[keys]] tenants."""
    return Authenticator(load_keys(config.api_key, config.api_key_file), {p.digest: p.name for p in config.keys})
