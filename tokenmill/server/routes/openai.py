"""OpenAI's /v1/models, /v1/chat/completions, /v1/completions and /v1/embeddings."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from tokenmill.server.chat import chat_response, chat_stream, prepare_chat
from tokenmill.server.completions import completion_response, completion_stream, prepare_completion
from tokenmill.server.deps import ServerState, api_key, serving_state
from tokenmill.server.embeddings import EmbeddingRequest, embeddings_response, prepare_embeddings
from tokenmill.server.limits import check_limits
from tokenmill.server.openapi import ChatCompletion, Completion, EmbeddingList, ModelList, error_responses
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.respond import respond
from tokenmill.server.serving import ServerContext

router = APIRouter(prefix="/v1")
GENERATION_ERRORS = error_responses(400, 401, 404, 429, 500, 503)


@router.get("/models", response_model=None, responses={200: {"model": ModelList}, **error_responses(401, 503)})
async def models(key_name: str | None = Depends(api_key), state: ServerState = Depends(serving_state)) -> dict:
    """The models (and routes) this server serves that the caller's key may use; a model not loaded (on demand)
    is listed too."""
    fleet, entries = state.fleet, []
    if fleet.lone and fleet.default.name is None:
        fleet.default.context()  # 503 while a lone model is loading: its name is not known yet
    for host in fleet.hosts:
        ctx = host.ctx
        card = {"object": "model", "created": state.created, "owned_by": "tokenmill",
                **({"max_model_len": ctx.client.info.max_model_len} if ctx is not None else {})}
        if any(state.tenants.may_use(key_name, i) for i in host.ids):  # an alias grants the model, as a name does
            entries += [{"id": i, **card, **({"root": host.name} if i != host.name else {})} for i in host.ids]
    entries += [{"id": name, "object": "model", "created": state.created, "owned_by": "tokenmill"}
                for name in fleet.routes if state.tenants.may_use(key_name, name)]
    return {"object": "list", "data": entries}


async def _generate(body, request: Request, key_name: str | None, state: ServerState, prepare, stream,
                    respond_whole):
    """Shared by both generation endpoints: the model (routing), the limits, validation + admission, the answer."""
    arrival = time.monotonic()

    async def attempt(ctx: ServerContext):
        check_limits(body, ctx.config)
        return ctx, await prepare(ctx, body, key_name, arrival)

    ctx, tracker = await state.router.serve(body, key_name, attempt, generation=True)
    return await respond(request, tracker, stream(ctx, body, tracker) if body.stream else None,
                         lambda: respond_whole(ctx, body, tracker))


@router.post("/chat/completions", response_model=None, responses={200: {"model": ChatCompletion}, **GENERATION_ERRORS})
async def chat(body: ChatCompletionRequest, request: Request, key_name: str | None = Depends(api_key),
               state: ServerState = Depends(serving_state)):
    return await _generate(body, request, key_name, state, prepare_chat, chat_stream, chat_response)


@router.post("/embeddings", response_model=None, responses={200: {"model": EmbeddingList}, **GENERATION_ERRORS})
async def embeddings(body: EmbeddingRequest, request: Request, key_name: str | None = Depends(api_key),
                     state: ServerState = Depends(serving_state)):
    arrival = time.monotonic()

    async def attempt(ctx: ServerContext):
        return ctx, await prepare_embeddings(ctx, body, key_name, arrival)

    ctx, tracker = await state.router.serve(body, key_name, attempt, generation=True)
    return await respond(request, tracker, None, lambda: embeddings_response(ctx, body, tracker))


@router.post("/completions", response_model=None, responses={200: {"model": Completion}, **GENERATION_ERRORS})
async def completions(body: CompletionRequest, request: Request, key_name: str | None = Depends(api_key),
                      state: ServerState = Depends(serving_state)):
    return await _generate(body, request, key_name, state, prepare_completion, completion_stream,
                           completion_response)
