"""Server-sent events bodies that clean up however they end: finished, client gone mid-stream, or
closed before the first byte (then the body's generator never ran, so its own `finally` cannot)."""
from __future__ import annotations

from typing import AsyncIterator

import msgspec
from quart import Response

from llaunch.runtime.http.engine_client import RequestGroup

DONE = b"data: [DONE]\n\n"


def sse_event(payload: object, prefix: bytes = b"data: ") -> bytes:
    return prefix + msgspec.json.encode(payload) + b"\n\n"


class TrackedStream:
    """Async iterator over SSE frames that, when it ends, closes its request group: aborts the
    group's unfinished requests and ends the HTTP request's count (so a drain can finish)."""

    def __init__(self, events: AsyncIterator[bytes], group: RequestGroup):
        self._events = events
        self._group = group

    def __aiter__(self) -> "TrackedStream":
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._events.__anext__()
        except BaseException:  # StopAsyncIteration included: the stream is over either way
            await self._group.close()
            raise

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._group.close()


def sse_response(body: TrackedStream) -> Response:
    response = Response(body, content_type="text/event-stream; charset=utf-8",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.timeout = None  # a long generation is not a stuck response
    return response
