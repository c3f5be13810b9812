"""OpenAI's /v1/models, /v1/chat/completions, /v1/completions and /v1/embeddings."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from tokenmill.server.chat import chat_response, chat_stream, prepare_chat
from tokenmill.server.completions import completion_response, completion_stream, prepare_completion
from tokenmill.server.deps import ServerState, api_key, check_model, ready_context, server_state
from tokenmill.server.embeddings import EmbeddingRequest, embeddings_response, prepare_embeddings
from tokenmill.server.limits import check_limits
from tokenmill.server.openapi import ChatCompletion, Completion, EmbeddingList, ModelList, error_responses
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.respond import respond
from tokenmill.server.serving import ServerContext

router = APIRouter(prefix="/v1")
GENERATION_ERRORS = error_responses(400, 401, 404, 429, 500, 503)


@router.get("/models", response_model=None, responses={200: {"model": ModelList}, **error_responses(401, 503)})
async def models(key_name: str | None = Depends(api_key), ctx: ServerContext = Depends(ready_context),
                 state: ServerState = Depends(server_state)) -> dict:
    """The models this server serves that the caller's key may use."""
    served = [ctx.model_name] if ctx.tenants.may_use(key_name, ctx.model_name) else []
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": state.created, "owned_by": "tokenmill",
        "max_model_len": ctx.client.info.max_model_len} for name in served]}


async def _generate(body, request: Request, key_name: str | None, ctx: ServerContext, prepare, stream, respond_whole):
    """Shared by both generation endpoints: the model, the limits, validation + admission, the answer."""
    arrival = time.monotonic()
    check_model(ctx, body.model, key_name)
    check_limits(body, ctx.config)
    tracker = await prepare(ctx, body, key_name, arrival)
    return await respond(request, tracker, stream(ctx, body, tracker) if body.stream else None,
                         lambda: respond_whole(ctx, body, tracker))


@router.post("/chat/completions", response_model=None, responses={200: {"model": ChatCompletion}, **GENERATION_ERRORS})
async def chat(body: ChatCompletionRequest, request: Request, key_name: str | None = Depends(api_key),
               ctx: ServerContext = Depends(ready_context)):
    return await _generate(body, request, key_name, ctx, prepare_chat, chat_stream, chat_response)


@router.post("/embeddings", response_model=None, responses={200: {"model": EmbeddingList}, **GENERATION_ERRORS})
async def embeddings(body: EmbeddingRequest, request: Request, key_name: str | None = Depends(api_key),
                     ctx: ServerContext = Depends(ready_context)):
    arrival = time.monotonic()
    check_model(ctx, body.model, key_name)
    tracker = await prepare_embeddings(ctx, body, key_name, arrival)
    return await respond(request, tracker, None, lambda: embeddings_response(ctx, body, tracker))


@router.post("/completions", response_model=None, responses={200: {"model": Completion}, **GENERATION_ERRORS})
async def completions(body: CompletionRequest, request: Request, key_name: str | None = Depends(api_key),
                      ctx: ServerContext = Depends(ready_context)):
    return await _generate(body, request, key_name, ctx, prepare_completion, completion_stream, completion_response)
