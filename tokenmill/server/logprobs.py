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


async def echo_logprobs(client: EngineClient, prompt: list[int], entries: list) -> dict[str, list]:
    """The prompt's part of ``echo`` + ``logprobs`` (OpenAI's legacy shape): its tokens with their logprobs and top
    candidates, ``null`` for the first (nothing predicts it); offsets count the tokens' own text."""
    ids = list(prompt) + [tid for e in entries if e for tid, _ in e[1]]
    piece = dict(zip(ids, await client.token_pieces(ids)))
    tokens, token_logprobs, tops, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(prompt, entries):
        tokens.append(piece[token_id].text)
        token_logprobs.append(entry[0] if entry else None)
        tops.append({piece[tid].text: lp for tid, lp in entry[1]} if entry else None)
        offsets.append(offset)
        offset += len(piece[token_id].text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


async def vllm_prompt_logprobs(client: EngineClient, prompt: list[int], entries: list) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first None), its own entry and its top candidates, keyed
    by token id: ``{"logprob", "rank", "decoded_token"}``."""
    ids = list(prompt) + [tid for e in entries if e for tid, _ in e[1]]
    piece = dict(zip(ids, await client.token_pieces(ids)))
    out: list[dict | None] = []
    for token_id, entry in zip(prompt, entries):
        if not entry:
            out.append(None)
            continue
        logprob, top, rank = entry
        ranked = {str(tid): {"logprob": lp, "rank": r, "decoded_token": piece[tid].text}
                  for r, (tid, lp) in enumerate(top, 1)}
        ranked[str(token_id)] = {"logprob": logprob, "rank": rank, "decoded_token": piece[token_id].text}
        out.append(ranked)
    return out
