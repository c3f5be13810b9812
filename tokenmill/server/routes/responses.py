"""OpenAI's Responses API: POST /v1/responses (server/responses.py) and the stored responses' GET / DELETE
(server/response_store.py), each under the caller's API key."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query, Request

from tokenmill.server.deps import ServerState, api_key, serving_state
from tokenmill.server.errors import APIError
from tokenmill.server.openapi import ItemList, ResponseDeleted, ResponseObject, error_responses
from tokenmill.server.respond import respond
from tokenmill.server.response_store import StoredResponse
from tokenmill.server.responses import prepare_response, response_stream, whole_response
from tokenmill.server.responses_input import ResponsesRequest
from tokenmill.server.serving import ServerContext

router = APIRouter(prefix="/v1")


@router.post("/responses", response_model=None, responses={
    200: {"model": ResponseObject}, **error_responses(400, 401, 404, 429, 500, 503)})
async def create_response(body: ResponsesRequest, request: Request, key_name: str | None = Depends(api_key),
                          state: ServerState = Depends(serving_state)):
    arrival = time.monotonic()

    async def attempt(ctx: ServerContext):
        return ctx, await prepare_response(ctx, body, key_name, arrival)

    ctx, exchange = await state.router.serve(body, key_name, attempt, generation=True)
    return await respond(request, exchange.tracker, response_stream(ctx, exchange) if body.stream else None,
                         lambda: whole_response(ctx, exchange))


def _stored(state: ServerState, key_name: str | None, response_id: str) -> StoredResponse:
    stored = state.responses.get(key_name, response_id)
    if stored is None:
        raise APIError(404, f"No response found with id '{response_id}'.", "invalid_request_error",
                       param="response_id", code="response_not_found")
    return stored


@router.get("/responses/{response_id}", response_model=None, responses={
    200: {"model": ResponseObject}, **error_responses(401, 404, 503)})
async def get_response(response_id: str, key_name: str | None = Depends(api_key),
                       state: ServerState = Depends(serving_state)) -> dict:
    return _stored(state, key_name, response_id).response


@router.delete("/responses/{response_id}", response_model=None, responses={
    200: {"model": ResponseDeleted}, **error_responses(401, 404, 503)})
async def delete_response(response_id: str, key_name: str | None = Depends(api_key),
                          state: ServerState = Depends(serving_state)) -> dict:
    _stored(state, key_name, response_id)
    state.responses.delete(key_name, response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/responses/{response_id}/input_items", response_model=None, responses={
    200: {"model": ItemList}, **error_responses(400, 401, 404, 503)})
async def list_input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                           order: str = Query("desc", pattern="^(asc|desc)$"), after: str | None = None,
                           key_name: str | None = Depends(api_key),
                           state: ServerState = Depends(serving_state)) -> dict:
    """The response's input items (previous responses' included), newest first unless ``order`` is asc; ``after`` is
    an item id to continue after. Items sent without an id get one here (``in_<index>``), stable per response."""
    items = [{"id": item.get("id") or f"in_{i}", **item} for i, item in
             enumerate(_stored(state, key_name, response_id).input_items)]
    items = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
