"""The FastAPI app: routes, auth, readiness, draining, in-flight accounting.

Lifecycle: the app answers at once; the engine loads in a background thread (``/ready`` is 503 and ``/v1/*``
is 503 until it is up). ``begin_drain`` turns ``/ready`` and new ``/v1/*`` requests to 503 while the
requests in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Header, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse

from tokenmill.server.auth import Authenticator
from tokenmill.server.chat import chat_response, chat_stream, prepare_chat
from tokenmill.server.completions import completion_response, completion_stream, prepare_completion
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.limits import BodySizeLimit, RequestLimits, check_limits
from tokenmill.server.openapi import (ChatCompletion, Completion, DetokenizeResponse, ModelList, TokenizeResponse,
                                      error_responses, install_openapi)
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenmill.server.serving import ServerContext
from tokenmill.server.tokenize import detokenize, tokenize

log = logging.getLogger(__name__)


class InFlight:
    """ASGI middleware counting /v1/ requests until their last response byte (streams included)."""

    def __init__(self, app: Any):
        self.app = app
        self.count = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


class _ReleasingEventSource(EventSourceResponse):
    """An SSE response (OpenAI's framing: ``data: ...\n\n``) that runs ``release`` once it is done, however
    it ends: a stream whose client left before its first byte never runs its generator's cleanup."""

    def __init__(self, content: Any, release: Callable[[], None]):
        super().__init__(content, sep="\n")
        self._release = release

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


class ServerState:
    def __init__(self, authenticator: Authenticator, auth_all_endpoints: bool):
        self.auth = authenticator
        self.auth_all_endpoints = auth_all_endpoints
        self.ctx: ServerContext | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.in_flight: InFlight | None = None
        self.created = int(time.time())
        # Called when the model fails to load: a server that can never be ready should exit, not linger.
        self.on_load_failure: Callable[[], None] = lambda: None

    def ready_context(self) -> ServerContext:
        if self.draining:
            raise APIError(503, "The server is shutting down.", "service_unavailable_error")
        if self.ctx is None:
            raise APIError(503, "The model is still loading.", "service_unavailable_error")
        if not self.ctx.client.healthy:
            raise APIError(503, f"The engine has failed ({self.ctx.client.error}); the server needs a restart.",
                           "service_unavailable_error")
        return self.ctx


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Run ``work``; if the client goes away first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def build_app(state: ServerState, load: Callable[[], ServerContext], cors_origins: list[str],
              max_body_bytes: int = RequestLimits.max_body_bytes) -> BodySizeLimit:
    """The ASGI app to serve: the FastAPI app wrapped in in-flight accounting (kept as state.in_flight) and the
    body-size limit."""
    def load_in_background() -> None:
        try:
            state.ctx = load()
        except BaseException as exc:  # noqa: BLE001 - reported by /health and the log
            log.error("model failed to load: %s", exc)
            state.load_error = exc
            state.on_load_failure()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=load_in_background, name="tokenmill-load", daemon=True).start()
        yield

    app = FastAPI(title="tokenmill", version=_version(), lifespan=lifespan)
    install_error_handlers(app)
    install_openapi(app)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"], allow_headers=["*"])

    def key_name(authorization: str | None, endpoint_is_open: bool = False) -> str | None:
        if endpoint_is_open and not state.auth_all_endpoints:
            return None
        return state.auth.check(authorization)

    @app.get("/health")
    async def health(authorization: str | None = Header(None)) -> JSONResponse:
        key_name(authorization, endpoint_is_open=True)
        failed = state.load_error or (state.ctx is not None and not state.ctx.client.healthy)
        return JSONResponse({"status": "error" if failed else "ok"}, status_code=503 if failed else 200)

    @app.get("/ready")
    async def ready(authorization: str | None = Header(None)) -> JSONResponse:
        key_name(authorization, endpoint_is_open=True)
        ok = state.ctx is not None and not state.draining and state.ctx.client.healthy
        reason = "draining" if state.draining else "ready" if ok else "loading"
        return JSONResponse({"status": reason}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(authorization: str | None = Header(None)) -> Response:
        key_name(authorization, endpoint_is_open=True)
        if state.ctx is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(state.ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **error_responses(401, 503)})
    async def models(authorization: str | None = Header(None)) -> dict:
        key_name(authorization)
        ctx = state.ready_context()
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": state.created, "owned_by": "tokenmill",
            "max_model_len": ctx.client.info.max_model_len}]}

    def check_model(ctx: ServerContext, model: str) -> None:
        if model != ctx.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", param="model",
                           code="model_not_found")

    def ready_for(authorization: str | None, model: str | None) -> tuple[str | None, ServerContext]:
        """Auth, readiness and the model check every model endpoint makes: (the key's name, the context)."""
        name = key_name(authorization)
        ctx = state.ready_context()
        if model is not None:
            check_model(ctx, model)
        return name, ctx

    async def _generate(body, request: Request, authorization: str | None, prepare, stream, respond):
        """Shared by both generation endpoints: auth, readiness, model check, validation + admission, answer."""
        arrival = time.monotonic()
        name, ctx = ready_for(authorization, body.model)
        check_limits(body, ctx.limits)
        tracker = await prepare(ctx, body, name, arrival)
        return await _respond(ctx, request, tracker, stream(ctx, body, tracker) if body.stream else None,
                              lambda: respond(ctx, body, tracker))

    generation_errors = error_responses(400, 401, 404, 429, 500, 503)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletion}, **generation_errors})
    async def chat(body: ChatCompletionRequest, request: Request, authorization: str | None = Header(None)):
        return await _generate(body, request, authorization, prepare_chat, chat_stream, chat_response)

    @app.post("/v1/completions", response_model=None, responses={200: {"model": Completion}, **generation_errors})
    async def completions(body: CompletionRequest, request: Request, authorization: str | None = Header(None)):
        return await _generate(body, request, authorization, prepare_completion, completion_stream,
                               completion_response)


    @app.post("/tokenize", response_model=None,
              responses={200: {"model": TokenizeResponse}, **error_responses(400, 401, 404, 503)})
    async def tokenize_route(body: TokenizeRequest, authorization: str | None = Header(None)) -> dict:
        return await tokenize(ready_for(authorization, body.model)[1], body)

    @app.post("/detokenize", response_model=None,
              responses={200: {"model": DetokenizeResponse}, **error_responses(400, 401, 404, 503)})
    async def detokenize_route(body: DetokenizeRequest, authorization: str | None = Header(None)) -> dict:
        return await detokenize(ready_for(authorization, body.model)[1], body)

    async def _respond(ctx, request, tracker, stream, make_body):
        """Admission reserved the requests' tokens; every path out of here releases what they did not."""
        request_ids = [r.request_id for r in tracker.requests]
        if stream is not None:
            async def logged():
                try:
                    async for data in stream:
                        yield {"data": data}
                finally:
                    tracker.log_line(200)
            return _ReleasingEventSource(logged(), lambda: ctx.client.release(request_ids))
        try:
            body = await _unless_disconnected(request, make_body())
        finally:
            ctx.client.release(request_ids)
        tracker.log_line(200 if body is not None else 499)
        return body if body is not None else Response(status_code=499)

    state.in_flight = InFlight(app)
    return BodySizeLimit(state.in_flight, max_body_bytes)
