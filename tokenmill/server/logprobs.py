"""Engine logprobs -> OpenAI's two shapes (chat: per-token objects; completions: parallel lists).

A token's text is the token decoded alone; its ``bytes`` are its exact bytes from the vocabulary, so that a character
split across tokens (an emoji, most CJK in a byte-level vocabulary) has bytes that concatenate to its UTF-8 encoding
where each piece's text is only U+FFFD. Token pieces come from the EngineClient, computed off the event loop.
"""

from __future__ import annotations

from typing import Any

from tokenmill.engine.client import EngineClient
from tokenmill.engine.messages import RequestOutput


async def _pieces(client: EngineClient, out: RequestOutput) -> dict:
    ids = list(out.new_token_ids) + [tid for _, top in out.new_logprobs for tid, _ in top]
    return dict(zip(ids, await client.token_pieces(ids)))


async def chat_logprobs(client: EngineClient, out: RequestOutput) -> list[dict[str, Any]]:
    if not out.new_logprobs:
        return []
    pieces = await _pieces(client, out)
    entries = []
    for token_id, (logprob, top) in zip(out.new_token_ids, out.new_logprobs):
        piece = pieces[token_id]
        entries.append({
            "token": piece.text, "logprob": logprob, "bytes": piece.bytes,
            "top_logprobs": [{"token": pieces[tid].text, "logprob": lp, "bytes": pieces[tid].bytes}
                             for tid, lp in top],
        })
    return entries


async def completion_logprobs(client: EngineClient, out: RequestOutput, text_offset: int) -> dict[str, list]:
    """Parallel lists for the tokens of one output; text_offset is where this output's text starts."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    if not out.new_logprobs:
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
    pieces = await _pieces(client, out)
    offset = text_offset
    for token_id, (logprob, top) in zip(out.new_token_ids, out.new_logprobs):
        text = pieces[token_id].text
        tokens.append(text)
        token_logprobs.append(logprob)
        tops.append({pieces[tid].text: lp for tid, lp in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
