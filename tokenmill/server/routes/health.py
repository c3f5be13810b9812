"""/health (live), /ready (serving), /metrics (Prometheus): the operator's endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenmill.server.deps import ServerState, operator_key, server_state

router = APIRouter(dependencies=[Depends(operator_key)])


@router.get("/health")
async def health(state: ServerState = Depends(server_state)) -> JSONResponse:
    failed = state.load_error or (state.ctx is not None and not state.ctx.client.healthy)
    return JSONResponse({"status": "error" if failed else "ok"}, status_code=503 if failed else 200)


@router.get("/ready")
async def ready(state: ServerState = Depends(server_state)) -> JSONResponse:
    ok = state.ctx is not None and not state.draining and state.ctx.client.healthy
    reason = "draining" if state.draining else "ready" if ok else "loading"
    return JSONResponse({"status": reason}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    if state.ctx is None:
        return Response("", media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(state.ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
