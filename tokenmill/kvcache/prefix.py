"""Block hashes for prefix caching. Pure Python: never imports torch.

A full block of ``block_size`` tokens is keyed by a hash chained over its whole prefix:
``hash_i = sha256(hash_{i-1} || extra_i || token ids of block i)``, with ``hash_{-1}`` a fixed root and ``extra_0``
the request's ``cache_salt`` (later blocks inherit it through the chain). Two requests share block i only if their
first ``(i + 1) * block_size`` tokens and their salts are equal. sha256 makes an accidental collision negligible, and
the pool still compares a hit's token ids before handing it out (block_pool.BlockPool.lookup).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from typing import Sequence

_ROOT = hashlib.sha256(b"tokenmill prefix cache v1").digest()


def scoped_salt(scope: str | None, salt: str | None) -> str | None:
    """The salt a request's blocks are hashed with: its ``scope`` (whose blocks it may share: set by the server from
    the caller's API key, never by the client) and the client's own ``cache_salt``, encoded together, so that no
    client's salt can read as another scope's; None when there is neither (every such request shares)."""
    return None if scope is None and salt is None else json.dumps([scope, salt])


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    """The chained hash of one full block; ``parent`` is the previous block's hash (None for the first block)."""
    h = hashlib.sha256(parent or _ROOT)
    if salt is not None:  # length-prefixed, so no salt reads as another salt followed by tokens
        encoded = salt.encode()
        h.update(len(encoded).to_bytes(8, "little") + encoded)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> list[bytes]:
    """Append to ``hashes`` (the hashes of the first len(hashes) blocks) those of every further full block."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt if i == 0 else None))
    return hashes
