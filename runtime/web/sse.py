"""Server-sent events bodies that clean up however they end: finished, client gone mid-stream, or
closed before the first byte (then the body's generator never ran, so its own `finally` cannot)."""
from __future__ import annotations

from typing import AsyncIterator, Protocol

import msgspec
from quart import Response

DONE = b"data: [DONE]\n\n"


def sse_event(payload: object, prefix: bytes = b"data: ") -> bytes:
    return prefix + msgspec.json.encode(payload) + b"\n\n"


class Closable(Protocol):
    async def close(self) -> None: ...


class TrackedStream:
    """Async iterator over SSE frames that, when it ends, closes what it streams for: a request group
    (aborts its unfinished requests, ends the HTTP request's count so a drain can finish) or a PD
    exchange (closes both upstream requests)."""

    def __init__(self, events: AsyncIterator[bytes], owner: Closable):
        self._events = events
        self._owner = owner

    def __aiter__(self) -> "TrackedStream":
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._events.__anext__()
        except BaseException:  # StopAsyncIteration included: the stream is over either way
            await self._owner.close()
            raise

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._owner.close()


def sse_response(body: TrackedStream, content_type: str = "text/event-stream; charset=utf-8") -> Response:
    response = Response(body, content_type=content_type,
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.timeout = None  # a long generation is not a stuck response
    return response
