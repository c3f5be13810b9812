"""Incremental detokenization with stop strings.

Invariants:
- every delta is valid text: a character whose bytes are split across tokens is held back until complete;
- the deltas of a finished request concatenate to exactly its final ``text``, which is
  ``tokenizer.decode(output_token_ids)`` cut before the first stop string (or after it, with
  ``include_stop_str``: vLLM's include_stop_str_in_output);
- while a request runs, the last ``len(longest stop string) - 1`` characters are held back, since they may be
  the start of a stop string that the next tokens complete.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded ahead of the output so that tokenizers which drop a leading space at the start of a
# decode (SentencePiece) render the first output token as it appears in context.
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # tokens[prefix_offset:read_offset] is the decoded window whose text already sits in self.text.
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.num_emitted = 0  # characters of self.text already returned as deltas
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)

    def update(self, new_token_ids: list[int], finished: bool) -> str:
        """Take the newly sampled tokens; return the text delta that may be sent now.

        After a stop string is found, ``stopped_by`` names it and the caller finishes the request.
        """
        if self.stopped_by is not None:
            return ""
        self.tokens.extend(new_token_ids)
        searched_up_to = len(self.text)
        self._advance(final=finished)
        if self.stop:
            self._find_stop(max(0, searched_up_to - self.holdback))
        done = finished or self.stopped_by is not None
        visible = len(self.text) if done else max(self.num_emitted, len(self.text) - self.holdback)
        delta = self.text[self.num_emitted:visible]
        self.num_emitted = visible
        return delta

    def _find_stop(self, start: int) -> None:
        hits = [(idx, s) for s in self.stop if (idx := self.text.find(s, start)) != -1]
        if hits:
            idx, s = min(hits)
            self.text = self.text[:idx + len(s) if self.include_stop_str else idx]
            self.stopped_by = s
