"""vLLM's POST /tokenize and /detokenize: count and inspect tokens as the server itself would see them."""

from __future__ import annotations

from typing import Any

from tokenmill.server.chat import render_chat, template_kwargs
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.server.serving import ServerContext


async def tokenize(ctx: ServerContext, body: TokenizeRequest) -> dict[str, Any]:
    """A prompt is encoded as /v1/completions encodes it (special tokens added unless add_special_tokens is false);
    messages are rendered exactly as /v1/chat/completions renders them (render_chat: the same tool plan)."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    client = ctx.client
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await client.encode(body.prompt, add_special)
    else:
        tokens, _ = await render_chat(ctx, body.messages, body.tools, body.tool_choice, body.parallel_tool_calls,
                                      body.add_generation_prompt, check_grammars=False,
                                      kwargs=template_kwargs(ctx, body.chat_template_kwargs))
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": client.info.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = await client.token_strings(tokens)
    return out


async def detokenize(ctx: ServerContext, body: DetokenizeRequest) -> dict[str, Any]:
    vocab = ctx.client.info.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {body.tokens[bad]} is outside the vocabulary [0, {vocab})", param=f"tokens.{bad}")
    return {"prompt": await ctx.client.decode(body.tokens)}
