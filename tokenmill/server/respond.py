"""One answer per generation request, streamed or whole, that always ends its Tracker (what the request holds is given
back exactly once, however the response ends) and aborts its engine requests when the client goes away.

A stream bounds what its client can hold up: the outputs waiting to be sent (``stream_buffer_bytes``, the Tracker's
``buffer_limit``) and the time one send may block (``stream_send_timeout_s``); past either, the stream is closed and
its engine requests aborted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError

from tokenmill.server.errors import request_id
from tokenmill.server.tracker import Tracker

log = logging.getLogger(__name__)


class _ClosingEventSource(EventSourceResponse):
    """An SSE response (OpenAI's framing: ``data: ...\\n\\n``) that closes its tracker once it is done, however it
    ends: a stream whose client left before its first byte never runs its generator's cleanup."""

    def __init__(self, content: Any, tracker: Tracker, send_timeout: float):
        super().__init__(content, sep="\n", send_timeout=send_timeout)
        self._tracker = tracker

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            log.warning("request %s: stream closed, its client took more than %g s to take one event",
                        request_id(), self.send_timeout)
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
    tracker: every way out closes it once. The engine starts at once, before the response's first byte is taken."""
    tracker.start()
    if stream is not None:
        config = tracker.ctx.config
        tracker.buffer_limit = config.stream_buffer_bytes

        async def logged():
            try:
                async for data in stream:  # a data payload, or a whole event (Anthropic's have names)
                    yield data if isinstance(data, dict) else {"data": data}
            finally:
                tracker.log_line(200)
        return _ClosingEventSource(logged(), tracker, config.stream_send_timeout_s)
    try:
        body = await _unless_disconnected(request, make_body())
    finally:
        tracker.close()
    tracker.log_line(200 if body is not None else 499)
    return body if body is not None else Response(status_code=499)
