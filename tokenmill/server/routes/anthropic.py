"""Anthropic's POST /v1/messages and /v1/messages/count_tokens (server/anthropic.py); errors in Anthropic's shape."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from tokenmill.server.anthropic import (CountTokensRequest, MessagesRequest, count_tokens, messages_response,
                                        messages_stream, prepare_messages)
from tokenmill.server.deps import ServerState, api_key, serving_state
from tokenmill.server.openapi import AnthropicMessage, TokenCount, anthropic_error_responses
from tokenmill.server.respond import respond
from tokenmill.server.serving import ServerContext

router = APIRouter(prefix="/v1")


@router.post("/messages", response_model=None, responses={
    200: {"model": AnthropicMessage}, **anthropic_error_responses(400, 401, 404, 429, 500, 503)})
async def messages(body: MessagesRequest, request: Request, key_name: str | None = Depends(api_key),
                   state: ServerState = Depends(serving_state)):
    arrival = time.monotonic()

    async def attempt(ctx: ServerContext):
        return ctx, await prepare_messages(ctx, body, key_name, arrival)

    ctx, tracker = await state.router.serve(body, key_name, attempt, generation=True)
    return await respond(request, tracker, messages_stream(ctx, body, tracker) if body.stream else None,
                         lambda: messages_response(ctx, body, tracker))


@router.post("/messages/count_tokens", response_model=None, responses={
    200: {"model": TokenCount}, **anthropic_error_responses(400, 401, 404, 503)})
async def messages_count_tokens(body: CountTokensRequest, key_name: str | None = Depends(api_key),
                                state: ServerState = Depends(serving_state)) -> dict:
    return await state.router.serve(body, key_name, lambda ctx: count_tokens(ctx, body))
