"""POST /v1/chat/completions, streaming (SSE) and not."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.serving import ServerContext, Tracker, make_requests, merged_outputs, sampling_params


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools or body.functions:
        raise bad_request("tools / function calling is not supported yet", param="tools")
    if body.tool_choice not in (None, "none"):
        raise bad_request("tool_choice is not supported yet", param="tool_choice")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise bad_request("only response_format type 'text' is supported yet", param="response_format")


def _messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise bad_request("only text content parts are supported", param=f"messages.{i}.content")
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


async def prepare_chat(ctx: ServerContext, body: ChatCompletionRequest, key_name: str | None,
                       arrival: float) -> Tracker:
    _reject_unsupported(body)
    try:
        prompt = await ctx.client.apply_chat_template(_messages(body))
    except Exception as exc:  # a template may raise anything (jinja errors, its own raise_exception)
        raise bad_request(f"the chat template refused these messages: {exc}", param="messages") from None
    top = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, max_tokens, top)
    requests = make_requests(ctx, [prompt], params, body.n, "messages", arrival, body.cache_salt)
    return Tracker(ctx, "chat", arrival, key_name, requests)


async def chat_response(ctx: ServerContext, body: ChatCompletionRequest, tracker: Tracker) -> dict[str, Any]:
    tokenizer = ctx.client.tokenizer
    texts = [""] * len(tracker.requests)
    logprobs: list[list] = [[] for _ in tracker.requests]
    reasons: list[str | None] = [None] * len(tracker.requests)
    async for index, out in merged_outputs(ctx.client, tracker.requests):
        tracker.observe(out)
        texts[index] += out.delta_text
        logprobs[index] += chat_logprobs(tokenizer, out)
        reasons[index] = out.finish_reason
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i], "refusal": None},
                "logprobs": {"content": logprobs[i]} if body.logprobs else None, "finish_reason": reasons[i]}
               for i in range(len(texts))]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": ctx.model_name, "choices": choices, "usage": tracker.usage(body.n), "system_fingerprint": None}


async def chat_stream(ctx: ServerContext, body: ChatCompletionRequest, tracker: Tracker) -> AsyncIterator[str]:
    """SSE data payloads: a role chunk per choice, content chunks, finish_reason on each choice's last chunk,
    an optional usage chunk with empty choices, then [DONE]. One id and created for all chunks."""
    tokenizer = ctx.client.tokenizer
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": ctx.model_name, "system_fingerprint": None}

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                  "finish_reason": finish_reason}
        payload = {**head, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return json.dumps(payload)

    for index in range(len(tracker.requests)):
        yield chunk(index, {"role": "assistant", "content": ""})
    try:
        async for index, out in merged_outputs(ctx.client, tracker.requests):
            tracker.observe(out)
            lps = chat_logprobs(tokenizer, out) if body.logprobs else None
            if out.delta_text or out.finished or lps:
                delta = {"content": out.delta_text} if out.delta_text or lps else {}
                yield chunk(index, delta, out.finish_reason if out.finished else None, lps)
    except APIError as exc:
        yield json.dumps(exc.body())
    if include_usage:
        yield json.dumps({**head, "choices": [], "usage": tracker.usage(body.n)})
    yield "[DONE]"
