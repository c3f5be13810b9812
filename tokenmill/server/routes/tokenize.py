"""vLLM's /tokenize and /detokenize (server/tokenize.py does the work)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from tokenmill.server.deps import api_key, check_model, ready_context
from tokenmill.server.openapi import DetokenizeResponse, TokenizeResponse, error_responses
from tokenmill.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.server.serving import ServerContext
from tokenmill.server.tokenize import detokenize, tokenize

router = APIRouter()


@router.post("/tokenize", response_model=None,
             responses={200: {"model": TokenizeResponse}, **error_responses(400, 401, 404, 503)})
async def tokenize_route(body: TokenizeRequest, key_name: str | None = Depends(api_key),
                         ctx: ServerContext = Depends(ready_context)) -> dict:
    check_model(ctx, body.model, key_name)
    return await tokenize(ctx, body)


@router.post("/detokenize", response_model=None,
             responses={200: {"model": DetokenizeResponse}, **error_responses(400, 401, 404, 503)})
async def detokenize_route(body: DetokenizeRequest, key_name: str | None = Depends(api_key),
                           ctx: ServerContext = Depends(ready_context)) -> dict:
    check_model(ctx, body.model, key_name)
    return await detokenize(ctx, body)
