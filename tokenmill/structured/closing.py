"""The shortest way out: a text that completes a grammar from a matcher's state, found greedily, so that a constrained
output near its max_tokens can be steered to a complete document instead of being cut mid-way.

From the state: take the jump-forward string (what the grammar forces), stop when the grammar is complete, else take
the first character of the preference order the grammar accepts -- inside a JSON string its closing quote first (a
brace is text there), outside one closers before separators before the cheapest values (``""``, ``0``, ``null``,
``false``, ``[]``, ``{}``) -- else the first allowed token of the vocabulary. Greedy, so not always the shortest, but
for JSON it closes open strings, arrays and objects and fills required properties with the smallest values; ``None``
when no completion is found within ``max_chars``. Whether the text is inside a string is read off the text itself
(unescaped quotes), which only orders the candidates: for other grammars it costs nothing but order.
"""

from __future__ import annotations

import math

import numpy as np
import xgrammar as xgr

from tokenmill.structured.grammar import check_deadline

OUTSIDE_STRING = ("}", "]", ",", '"', "0", "n", "f", "[", "{", ":")
INSIDE_STRING = ('"',)


def closing_text(matcher: xgr.GrammarMatcher, accepted_text: str, decode_token, width: int,
                 stop_token_ids: set[int], max_chars: int = 512, deadline: float = math.inf) -> str | None:
    """Text that, appended to ``accepted_text`` (what ``matcher`` accepted), completes its grammar; the matcher is
    not changed. GrammarBudgetError once ``deadline`` has passed (checked between xgrammar calls)."""
    m = matcher.fork()
    out: list[str] = []
    in_string = _ends_in_string(accepted_text, False)
    while sum(map(len, out)) <= max_chars:
        check_deadline(deadline)
        if m.is_completed():
            return "".join(out)
        forced = m.find_jump_forward_string()
        if forced:
            m.accept_string(forced)
            text = forced
        else:
            step = _first_accepted(m, INSIDE_STRING if in_string else OUTSIDE_STRING) or \
                _first_allowed_token(m, decode_token, width, stop_token_ids, deadline)
            if step is None:
                return None
            m, text = step
        out.append(text)
        in_string = _ends_in_string(text, in_string)
    return None


def continuation_text(matcher: xgr.GrammarMatcher, accepted_text: str, decode_token, width: int,
                      stop_token_ids: set[int], deadline: float = math.inf) -> str | None:
    """For a complete output: the shortest text that continues it (one token that is not a stop token, then the
    closing text from there), i.e. what one more list item or tool call would cost at least; None when nothing but a
    stop token may follow."""
    step = _first_allowed_token(matcher, decode_token, width, stop_token_ids, deadline)
    if step is None:
        return None
    m, first = step
    rest = closing_text(m, accepted_text + first, decode_token, width, stop_token_ids, deadline=deadline)
    return None if rest is None else first + rest


def _ends_in_string(text: str, in_string: bool) -> bool:
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and in_string:
            escaped = True
        elif ch == '"':
            in_string = not in_string
    return in_string


def _first_accepted(m: xgr.GrammarMatcher, candidates) -> tuple[xgr.GrammarMatcher, str] | None:
    for text in candidates:
        trial = m.fork()
        if trial.accept_string(text):
            return trial, text
    return None


def allowed_tokens(m: xgr.GrammarMatcher, width: int) -> np.ndarray:
    """[width * 32] 0/1: the tokens the grammar allows next (token t at index t)."""
    mask = np.zeros((1, width), dtype=np.int32)
    m.fill_next_token_bitmask(mask)
    return np.unpackbits(mask.view(np.uint8), bitorder="little")


def _first_allowed_token(m: xgr.GrammarMatcher, decode_token, width: int, stop_token_ids: set[int],
                         deadline: float = math.inf):
    for token in np.flatnonzero(allowed_tokens(m, width)).tolist():
        check_deadline(deadline)
        if token in stop_token_ids:
            continue
        text = decode_token(token)
        trial = m.fork()
        if text and trial.accept_token(token):
            return trial, text
    return None
