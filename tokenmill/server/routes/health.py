"""/health (live), /ready (serving), /metrics (Prometheus): the operator's endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenmill.server.deps import ServerState, operator_key, server_state
from tokenmill.server.errors import APIError

router = APIRouter(dependencies=[Depends(operator_key)])


@router.get("/health")
async def health(state: ServerState = Depends(server_state)) -> JSONResponse:
    """Live: 503 once a lone model has failed (to load, or its engine: the server is about to exit); with several
    models, each one's state is listed and a model being restarted is not a failure of the server."""
    fleet = state.fleet
    failed = state.load_error is not None or (fleet.lone and state.ctx is not None and not state.ctx.client.healthy)
    body = {"status": "error" if failed else "ok"}
    if not fleet.lone:
        body["models"] = fleet.statuses()
    return JSONResponse(body, status_code=503 if failed else 200)


@router.get("/ready")
async def ready(model: str | None = None, state: ServerState = Depends(server_state)) -> JSONResponse:
    """Serving: every model loaded at start-up is ready (``?model=NAME``: that model, by name or alias)."""
    ok, status = state.fleet.ready(model)
    if status == "unknown model":  # a refusal of the request, in the API's error shape
        return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found").response()
    if state.draining:
        ok, status = False, "draining"
    body = {"status": status}
    if model is None and not state.fleet.lone:
        body["models"] = state.fleet.statuses()
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
