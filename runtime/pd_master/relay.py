"""One client request through a prefill/decode pair: the same request goes to the decode instance D
(whose answer the client gets, streamed chunk by chunk) and, once it is on the wire, to the prefill
instance P with D's KV address (P computes the prompt's KV, ships it to D, answers 200).

Failures end in a clean answer: P failing cancels D and answers P's 4xx as is or a 502 (or, once a
stream started, one SSE error event); D unreachable or breaking mid-stream marks D unhealthy and
answers the same way. Every path closes both upstream requests (an instance aborts a request and
frees its KV when its connection closes) and ends the in-flight counts exactly once.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Optional

import httpx
import msgspec
from quart import Response

from llaunch.runtime.web.errors import ApiError, json_response
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.ipc.pd import DECODE_KV_HEADER, PD_ID_HEADER
from llaunch.runtime.web.sse import DONE, TrackedStream, sse_event, sse_response
from llaunch.runtime.pd_master.registry import Instance, InstanceRegistry

log = logging.getLogger(__name__)

FORWARDED_HEADERS = ("authorization", "content-type", "accept")
_END = object()


class Refusal(Exception):
    """The answer the client gets instead of D's: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, body: dict):
        super().__init__(body.get("error", {}).get("message", str(body)))
        self.status = status
        self.body = body

    @staticmethod
    def of(status: int, message: str, code: str, type: str = "server_error") -> "Refusal":
        return Refusal(status, ApiError(status, message, type=type, code=code).body())

    def response(self) -> Response:
        return json_response(self.body, status=self.status)


def _error_body(response: httpx.Response) -> dict:
    """An instance's error as it sent it, when it is the OpenAI shape; else wrapped in that shape."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    text = response.text[:500]
    return ApiError(response.status_code, f"HTTP {response.status_code}: {text}", type="server_error").body()


async def _next_chunk(chunks: AsyncIterator[bytes]) -> Any:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:  # a Task cannot carry StopAsyncIteration out
        return _END


class PdExchange:
    def __init__(self, client: httpx.AsyncClient, registry: InstanceRegistry, pair: tuple[Instance, Instance],
                 path: str, body: bytes, headers: dict[str, str], lifecycle: Lifecycle,
                 spawn: Callable[[Coroutine], None], prefill_settle_s: float = 10.0):
        """`pair` was counted in flight by `registry.pick_pair`; this exchange ends both counts."""
        self.client, self.registry, self.lifecycle, self.spawn = client, registry, lifecycle, spawn
        self.prefill, self.decode = pair
        self.path, self.body = path, body
        self.pd_id = uuid.uuid4().hex
        self.headers = headers | {PD_ID_HEADER: self.pd_id}
        self.prefill_settle_s = prefill_settle_s
        self.lightllm_stream = path == "/generate_stream"  # its events are `data:{...}` and end without [DONE]
        self._decode_sent = asyncio.Event()
        self._decode_task: Optional[asyncio.Task] = None
        self._prefill_task: Optional[asyncio.Task] = None
        self._decode_ok = False  # D's answer arrived whole: P has shipped the KV
        self._closed = False

    # ---- the exchange ----------------------------------------------------------------------------

    async def answer(self) -> Response:
        self.lifecycle.begin()
        try:
            self._decode_task = asyncio.ensure_future(self._open_decode())
            self._prefill_task = asyncio.ensure_future(self._run_prefill())
            self._prefill_task.add_done_callback(lambda _: self.registry.end(self.prefill))
            return await self._answer()
        except BaseException:
            await self.close()
            raise

    async def _answer(self) -> Response:
        try:
            response = await self._race(self._decode_task)
            if response.status_code != 200:  # D refused (bad request, draining): its answer, as is
                content = await response.aread()
                await self.close()
                return Response(content, status=response.status_code,
                                content_type=response.headers.get("content-type", "application/json"))
            content_type = response.headers.get("content-type", "application/json")
            if not content_type.startswith("text/event-stream"):
                content = await self._race(response.aread())
                self._decode_ok = True
                await self.close()
                return Response(content, status=200, content_type=content_type)
            chunks = response.aiter_bytes()
            first = await self._race(_next_chunk(chunks))  # nothing sent yet: a failure is still a plain error
        except Refusal as refusal:
            await self.close()
            return refusal.response()
        except (httpx.HTTPError, httpx.StreamError) as e:
            refusal = self._decode_broke(e)
            await self.close()
            return refusal.response()
        if first is _END:
            self._decode_ok = True
            await self.close()
            return Response(b"", status=200, content_type=content_type)
        return sse_response(TrackedStream(self._relay(chunks, first), self), content_type)

    async def _relay(self, chunks: AsyncIterator[bytes], first: bytes) -> AsyncIterator[bytes]:
        last = first
        yield first
        try:
            while (chunk := await self._race(_next_chunk(chunks))) is not _END:
                last = chunk
                yield chunk
            self._decode_ok = True
        except Refusal as refusal:
            for event in self._error_events(last, refusal.body):
                yield event
        except (httpx.HTTPError, httpx.StreamError) as e:
            for event in self._error_events(last, self._decode_broke(e).body):
                yield event

    def _error_events(self, last: bytes, body: dict) -> list[bytes]:
        events = [] if last.endswith(b"\n\n") else [b"\n\n"]  # D broke inside an event: end it first
        if self.lightllm_stream:
            return events + [sse_event(body, prefix=b"data:")]
        return events + [sse_event(body), DONE]

    # ---- the two upstream requests -------------------------------------------------------------

    async def _open_decode(self) -> httpx.Response:
        async def trace(event: str, _info: dict) -> None:
            if event.endswith("send_request_body.complete"):
                self._decode_sent.set()

        request = self.client.build_request("POST", self.decode.url + self.path, content=self.body,
                                            headers=self.headers, extensions={"trace": trace})
        return await self.client.send(request, stream=True)

    async def _run_prefill(self) -> Optional[Refusal]:
        """None once P has shipped the KV; else the Refusal to answer. Never raises."""
        sent = asyncio.ensure_future(self._decode_sent.wait())
        try:  # until D's request is on the wire (D waits for the KV from then on) or D failed
            await asyncio.wait({sent, self._decode_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sent.cancel()
        if self._decode_task.done() and (self._decode_task.cancelled() or self._decode_task.exception()):
            return Refusal.of(502, f"decode instance {self.decode.id} failed before the prefill", "decode_failed")
        p = self.prefill
        headers = self.headers | {DECODE_KV_HEADER: self.decode.kv_address or ""}
        try:
            response = await self.client.post(p.url + self.path, content=self.body, headers=headers)
        except httpx.HTTPError as e:
            self.registry.mark_unhealthy(p.id)
            log.warning("pd %s: prefill instance %s unreachable: %r", self.pd_id, p.id, e)
            return Refusal.of(502, f"The prefill instance {p.id} is unreachable ({type(e).__name__}).",
                              "prefill_unreachable")
        except Exception as e:  # never leave the pair waiting on a bug here
            log.exception("pd %s: prefill request failed", self.pd_id)
            return Refusal.of(502, f"The prefill request failed ({type(e).__name__}: {e}).", "prefill_failed")
        if response.status_code == 200:
            self._record_transfer(response)
            return None
        body = _error_body(response)
        log.warning("pd %s: prefill instance %s answered %d: %s", self.pd_id, p.id, response.status_code, body)
        if 400 <= response.status_code < 500:
            return Refusal(response.status_code, body)
        message = body["error"].get("message", "")
        return Refusal.of(502, f"The prefill instance {p.id} failed (HTTP {response.status_code}: {message}).",
                          "prefill_failed")

    def _record_transfer(self, response: httpx.Response) -> None:
        try:
            ms = float(msgspec.json.decode(response.content).get("kv_transfer_ms", 0.0))
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
            return
        self.registry.record_transfer(self.prefill, ms)

    def _decode_broke(self, error: Exception) -> Refusal:
        self.registry.mark_unhealthy(self.decode.id)
        log.warning("pd %s: decode instance %s failed: %r; marked unhealthy", self.pd_id, self.decode.id, error)
        return Refusal.of(502, f"The decode instance {self.decode.id} failed ({type(error).__name__}).",
                          "decode_failed")

    async def _race(self, awaitable: Awaitable) -> Any:
        """`awaitable`'s result, unless P fails first: then it is cancelled and P's Refusal raised."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                waiting = {task} if self._prefill_task.done() else {task, self._prefill_task}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                refusal = self._prefill_task.result()
                if refusal is not None:
                    raise refusal
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    # ---- the end ---------------------------------------------------------------------------------

    async def close(self) -> None:
        """Close D's request (D aborts it unless it finished) and settle P's; end the in-flight counts."""
        if self._closed:
            return
        self._closed = True
        try:
            task = self._decode_task
            if task is not None:
                if not task.done():
                    task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if not task.cancelled() and task.exception() is None:
                    try:
                        await task.result().aclose()  # unread: closes the connection, so D aborts
                    except httpx.HTTPError:
                        pass
            prefill = self._prefill_task
            if prefill is not None and not prefill.done():
                if self._decode_ok:  # D had the KV, so P's 200 is on its way: wait for it off the response
                    self.spawn(self._settle_prefill(prefill))
                else:
                    prefill.cancel()
        finally:
            self.registry.end(self.decode)
            if self._prefill_task is None:  # never started: its done-callback will not end the count
                self.registry.end(self.prefill)
            self.lifecycle.end()

    async def _settle_prefill(self, prefill: asyncio.Task) -> None:
        try:
            refusal = await asyncio.wait_for(prefill, self.prefill_settle_s)
        except asyncio.TimeoutError:
            log.warning("pd %s: prefill instance %s did not answer within %.0f s after the decode finished",
                        self.pd_id, self.prefill.id, self.prefill_settle_s)
            return
        if refusal is not None:
            log.warning("pd %s: decode finished but the prefill failed: %s", self.pd_id, refusal)
