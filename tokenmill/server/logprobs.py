"""Engine logprobs -> OpenAI's two shapes (chat: per-token objects; completions: parallel lists)."""

from __future__ import annotations

from typing import Any, Protocol

from tokenmill.engine.messages import RequestOutput


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, out: RequestOutput) -> list[dict[str, Any]]:
    entries = []
    for token_id, (logprob, top) in zip(out.new_token_ids, out.new_logprobs):
        text = _token_text(tokenizer, token_id)
        entries.append({
            "token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _token_text(tokenizer, tid)), "logprob": lp, "bytes": list(t.encode())}
                             for tid, lp in top],
        })
    return entries


def completion_logprobs(tokenizer: Tokenizer, out: RequestOutput, text_offset: int) -> dict[str, list]:
    """Parallel lists for the tokens of one output; text_offset is where this output's text starts."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, (logprob, top) in zip(out.new_token_ids, out.new_logprobs):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        tops.append({_token_text(tokenizer, tid): lp for tid, lp in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
