"""One answer per generation request, streamed or whole, that always ends its Tracker (the admission reservation is
given back exactly once, however the response ends) and aborts its engine requests when the client goes away."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse

from tokenmill.server.serving import Tracker


class _ClosingEventSource(EventSourceResponse):
    """An SSE response (OpenAI's framing: ``data: ...\\n\\n``) that closes its tracker once it is done, however it
    ends: a stream whose client left before its first byte never runs its generator's cleanup."""

    def __init__(self, content: Any, tracker: Tracker):
        super().__init__(content, sep="\n")
        self._tracker = tracker

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._tracker.close()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
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


async def respond(request: Request, tracker: Tracker, stream: AsyncIterator[str | dict] | None,
                  make_body: Callable[[], Awaitable[dict]]) -> Any:
    """The stream as SSE events, or the body (499 when the client left first). From here on the response owns the
    tracker: every way out closes it once."""
    if stream is not None:
        async def logged():
            try:
                async for data in stream:  # a data payload, or a whole event (Anthropic's have names)
                    yield data if isinstance(data, dict) else {"data": data}
            finally:
                tracker.log_line(200)
        return _ClosingEventSource(logged(), tracker)
    try:
        body = await _unless_disconnected(request, make_body())
    finally:
        tracker.close()
    tracker.log_line(200 if body is not None else 499)
    return body if body is not None else Response(status_code=499)
