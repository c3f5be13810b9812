"""vLLM's /tokenize and /detokenize (server/tokenize.py does the work)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from tokenmill.server.deps import ServerState, api_key, serving_state
from tokenmill.server.openapi import DetokenizeResponse, TokenizeResponse, error_responses
from tokenmill.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.server.tokenize import detokenize, tokenize

router = APIRouter()


@router.post("/tokenize", response_model=None,
             responses={200: {"model": TokenizeResponse}, **error_responses(400, 401, 404, 503)})
async def tokenize_route(body: TokenizeRequest, key_name: str | None = Depends(api_key),
                         state: ServerState = Depends(serving_state)) -> dict:
    return await state.router.serve(body, key_name, lambda ctx: tokenize(ctx, body))


@router.post("/detokenize", response_model=None,
             responses={200: {"model": DetokenizeResponse}, **error_responses(400, 401, 404, 503)})
async def detokenize_route(body: DetokenizeRequest, key_name: str | None = Depends(api_key),
                           state: ServerState = Depends(serving_state)) -> dict:
    return await state.router.serve(body, key_name, lambda ctx: detokenize(ctx, body))
