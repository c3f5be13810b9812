"""The engine's grammar state: one xgrammar matcher per constrained request, advanced by the tokens the request
keeps. Each step it gives the allowed-token bitmask of every position a constrained request samples at (after its
known tokens, and after each of its drafts), and it cuts drafts to the prefix the grammar accepts.

Bitmask layout (xgrammar's): int32 [positions, ceil(vocab / 32)]; bit ``t % 32`` of word ``t // 32`` set = token t
allowed.

Steering near max_tokens: within ``ZONE`` tokens of a request's max_tokens the matchers look for the way out
(structured/closing.py). Once the closing text needs all the tokens left but ``MARGIN`` (the most one free token
is expected to add to it), its tokens are forced one by one: the output ends complete (the grammar then allows only
its stop token, or more text that keeps it complete) instead of being cut mid-document. An output that is complete
already is left free, unless only structure may follow (fewer than half the vocabulary allowed: another tool call,
another list item) and the shortest such continuation would not fit with ``MARGIN`` to spare: then it stops there
rather than start what it cannot finish. Free text (a plain answer beside optional tool calls) is never cut short.
The closing is recomputed every ``RECHECK`` tokens, and every token once the end or the output's completion is near.
When even the shortest closing does not fit, the output is cut at max_tokens as before: finish_reason "length", a
valid prefix.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol

import numpy as np
import xgrammar as xgr

from tokenmill.structured.closing import allowed_tokens, closing_text, continuation_text
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.structured.spec import GrammarSpec

log = logging.getLogger(__name__)

ZONE, MARGIN, RECHECK = 64, 8, 4


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class GrammarMatchers:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, tokenizer: Tokenizer, stop_token_ids: list[int]):
        self.compiler = compiler
        self.width = -(-vocab_size // 32)
        self.tokenizer = tokenizer
        self.stop_token_ids = set(stop_token_ids)
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._closing: dict[str, tuple[int, int]] = {}  # request id -> (tokens left when computed, closing length)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def add(self, request_id: str, spec: GrammarSpec, max_bytes: float = math.inf, deadline: float = math.inf) -> None:
        """Raises GrammarError when the spec does not compile (GrammarCompiler.compile's budget errors too)."""
        compiled = self.compiler.compile(spec, max_bytes, deadline)
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar >= 0.2

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._closing.pop(request_id, None)

    def steer(self, request_id: str, tokens_left: int, output_token_ids: list[int],
              deadline: float = math.inf) -> np.ndarray | None:
        """[1, width]: the one token the request must take now to end complete within ``tokens_left`` tokens (the
        closing text's next token, or a stop token), or None to leave it free."""
        if tokens_left > ZONE:
            return None
        last = self._closing.get(request_id)
        if last is not None and last[0] - tokens_left < RECHECK and last[1] > MARGIN \
                and tokens_left > last[1] + 2 * MARGIN:
            return None  # checked lately, far from complete and far from the end
        matcher, accepted = self._matchers[request_id], self.tokenizer.decode(output_token_ids)
        text = closing_text(matcher, accepted, self._decode_one, self.width, self.stop_token_ids, deadline=deadline)
        if text is None:
            return None
        if not text:  # complete already
            return self._stop_mask(matcher, accepted, tokens_left, deadline)
        closing = self.tokenizer.encode(text, add_special_tokens=False)
        self._closing[request_id] = (tokens_left, len(closing))
        if len(closing) + MARGIN < tokens_left:
            return None
        if not matcher.fork().accept_token(closing[0]):
            return None
        return self._only(closing[0])

    def _stop_mask(self, matcher: xgr.GrammarMatcher, accepted: str, tokens_left: int,
                   deadline: float = math.inf) -> np.ndarray | None:
        """Only a stop token, for a complete output (``accepted``, its text) that allows no free text (fewer than
        half the vocabulary) and whose shortest continuation would not fit in ``tokens_left`` with MARGIN to spare."""
        bits = allowed_tokens(matcher, self.width)
        stops = [t for t in sorted(self.stop_token_ids) if t < len(bits) and bits[t]]
        if not stops or bits.sum() * 2 > self.width * 32:
            return None
        more = continuation_text(matcher, accepted, self._decode_one, self.width, self.stop_token_ids, deadline)
        if more and len(self.tokenizer.encode(more, add_special_tokens=False)) + MARGIN < tokens_left:
            return None
        return self._only(stops[0])

    def _only(self, token: int) -> np.ndarray:
        mask = np.zeros((1, self.width), dtype=np.uint32)
        mask[0, token // 32] = 1 << (token % 32)
        return mask.view(np.int32)

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=True)

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
