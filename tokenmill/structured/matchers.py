"""The engine's grammar state: one xgrammar matcher per constrained request, advanced by the tokens the request
keeps. Each step it gives the allowed-token bitmask of every position a constrained request samples at (after its
known tokens, and after each of its drafts), and it cuts drafts to the prefix the grammar accepts.

Bitmask layout (xgrammar's): int32 [positions, ceil(vocab / 32)]; bit ``t % 32`` of word ``t // 32`` set = token t
allowed.
"""

from __future__ import annotations

import logging

import numpy as np
import xgrammar as xgr

from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.structured.spec import GrammarSpec

log = logging.getLogger(__name__)


class GrammarMatchers:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int):
        self.compiler = compiler
        self.width = -(-vocab_size // 32)
        self._matchers: dict[str, xgr.GrammarMatcher] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, spec: GrammarSpec) -> None:
        """Raises GrammarError when the spec does not compile."""
        compiled = self.compiler.compile(spec)
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar >= 0.2

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def bitmask(self, request_id: str, drafts: list[int]) -> np.ndarray:
        """[1 + len(drafts), width] int32: the allowed tokens after the request's known tokens and after each
        draft (the drafts were cut by ``valid_drafts``, so the matcher accepts them)."""
        matcher = self._matchers[request_id]
        mask = np.zeros((1 + len(drafts), self.width), dtype=np.int32)
        matcher.fill_next_token_bitmask(mask, 0)
        for j, token in enumerate(drafts):
            matcher.accept_token(token)
            matcher.fill_next_token_bitmask(mask, j + 1)
        if drafts:
            matcher.rollback(len(drafts))
        return mask

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar accepts after the known tokens (a draft past the grammar's
        end included: nothing may follow it)."""
        matcher, kept = self._matchers[request_id], 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            kept += 1
        if kept:
            matcher.rollback(kept)
        return drafts[:kept]

    def accept(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by the tokens the request kept; True when the output is complete (the grammar accepted its stop
        token, or can take nothing more) or a token broke it (logged: only a min_tokens ban that removed every
        token the grammar allows can force one)."""
        matcher = self._matchers[request_id]
        for token in tokens:
            if not matcher.accept_token(token):
                log.warning("request %s: token %d is outside its grammar; finishing it", request_id, token)
                return True
        return matcher.is_terminated()
