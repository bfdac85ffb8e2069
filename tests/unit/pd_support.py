"""Fakes for the pd_master tests: one event loop in a thread serving apps on real ports, and fake
prefill and decode instances that keep the protocol's one real dependency: a decode answers only once
"its" KV arrived, i.e. once a prefill shipped to the decode's kv_address under the same pd id. So a
relay that pairs the wrong instances, drops a header or waits for D before calling P hangs instead of
passing."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from typing import Optional

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from quart import Quart, Response, request

from llaunch.runtime.ipc.pd import DECODE_KV_HEADER, PD_ID_HEADER

PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream")
KV_WAIT_S = 5.0


class Loop:
    """One event loop in a thread serving every app of a test (master, fakes, config server)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._stops: list[tuple[asyncio.Event, object]] = []

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: Quart) -> str:
        sock = socket.create_server(("127.0.0.1", 0))  # listening before Hypercorn starts: no race
        port = sock.getsockname()[1]
        config = HypercornConfig()
        config.bind = [f"fd://{sock.detach()}"]
        config.accesslog = None
        config.graceful_timeout = 0.2

        async def start():
            stop = asyncio.Event()
            return stop, asyncio.ensure_future(serve(app, config, shutdown_trigger=stop.wait))

        self._stops.append(self.run(start()))
        return f"http://127.0.0.1:{port}"

    def serve_raw(self, handler) -> str:
        async def start():
            server = await asyncio.start_server(handler, "127.0.0.1", 0)
            return server, server.sockets[0].getsockname()[1]

        server, port = self.run(start())
        self._stops.append((None, server))
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        async def stop_all():
            for stop, task in self._stops:
                if stop is None:
                    task.close()
                else:
                    stop.set()
            await asyncio.gather(*(t for s, t in self._stops if s is not None), return_exceptions=True)

        self.run(stop_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class KvBoard:
    """Where fake prefills 'ship' KV and fake decodes wait for it, keyed by (kv_address, pd id)."""

    def __init__(self) -> None:
        self._arrived: dict[tuple[str, str], asyncio.Event] = {}

    def _event(self, kv_address: str, pd_id: str) -> asyncio.Event:
        return self._arrived.setdefault((kv_address, pd_id), asyncio.Event())

    def prefill_started(self, pd_id: str) -> None:
        self._event("prefill", pd_id).set()

    async def wait_prefill_started(self, pd_id: str) -> None:
        await asyncio.wait_for(self._event("prefill", pd_id).wait(), KV_WAIT_S)

    def ship(self, kv_address: str, pd_id: str) -> None:
        self._event(kv_address, pd_id).set()

    async def wait(self, kv_address: str, pd_id: str) -> None:
        await asyncio.wait_for(self._event(kv_address, pd_id).wait(), KV_WAIT_S)


def chunk(text: str, finish: Optional[str] = None) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FakeDecode:
    """A decode instance: streams an opening chunk at once, the words once its KV arrived, then [DONE];
    non-stream answers once the KV arrived. Records requests, finished and aborted pd ids."""

    def __init__(self, board: KvBoard, name: str, words=("Paris", " is", " nice"), delay_s: float = 0.01):
        self.board, self.name, self.words, self.delay_s = board, name, words, delay_s
        self.kv_address = f"tcp://{name}:7000"
        self.requests: list[tuple[str, str, dict]] = []  # (path, pd id, body)
        self.finished: list[str] = []
        self.aborted: list[str] = []  # its client (the master) went away
        self.timed_out: list[str] = []  # the KV never came
        self.authorization: list[Optional[str]] = []  # the header each request came with
        self.gate: Optional[asyncio.Event] = None  # set: hold the stream after the first word until set
        self.app = Quart(name)
        for path in PATHS:
            self.app.add_url_rule(path, endpoint=path, view_func=self.generate, methods=["POST"])
        self.app.add_url_rule("/v1/models", view_func=self.models)

    async def models(self) -> Response:
        return Response(json.dumps({"object": "list", "data": [{"id": self.name}]}), content_type="application/json")

    async def generate(self) -> Response:
        pd_id, body = request.headers[PD_ID_HEADER], await request.get_json()
        self.requests.append((request.path, pd_id, body))
        self.authorization.append(request.headers.get("Authorization"))
        if body.get("bad"):  # refuse once P works on it too, so the master has a P request to cancel
            await self.board.wait_prefill_started(pd_id)
            return Response(json.dumps({"error": {"message": "bad request", "type": "invalid_request_error",
                                                  "param": "bad", "code": None}}), 400, content_type="application/json")
        if body.get("stream") or request.path == "/generate_stream":
            return Response(self.events(pd_id), content_type="text/event-stream; charset=utf-8")
        with self.outcome(pd_id):
            await self.board.wait(self.kv_address, pd_id)
        return Response(json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                                    "choices": [{"index": 0, "text": "".join(self.words), "finish_reason": "stop",
                                                 "logprobs": None}], "served_by": self.name}),
                        content_type="application/json")

    @contextlib.contextmanager
    def outcome(self, pd_id: str):
        outcome = self.aborted
        try:
            yield
            outcome = self.finished
        except asyncio.TimeoutError:
            outcome = self.timed_out
            raise
        finally:
            outcome.append(pd_id)

    async def events(self, pd_id: str):
        with self.outcome(pd_id):
            yield chunk("")
            await self.board.wait(self.kv_address, pd_id)
            for i, word in enumerate(self.words):
                yield chunk(word, "stop" if i == len(self.words) - 1 else None)
                if i == 0 and self.gate is not None:
                    await asyncio.wait_for(self.gate.wait(), KV_WAIT_S)
                await asyncio.sleep(self.delay_s)
            yield b"data: [DONE]\n\n"


class FakePrefill:
    """A prefill instance: ships the KV to the address the master names, then answers 200; or fails
    with `status` (before shipping anything)."""

    def __init__(self, board: KvBoard, name: str, status: int = 200, delay_s: float = 0.02):
        self.board, self.name, self.status, self.delay_s = board, name, status, delay_s
        self.requests: list[tuple[str, str, str, dict]] = []  # (path, pd id, decode kv, body)
        self.cancelled: list[str] = []  # its client (the master) went away before the answer
        self.app = Quart(name)
        for path in PATHS:
            self.app.add_url_rule(path, endpoint=path, view_func=self.prefill, methods=["POST"])

    async def prefill(self) -> Response:
        pd_id, kv = request.headers[PD_ID_HEADER], request.headers[DECODE_KV_HEADER]
        self.requests.append((request.path, pd_id, kv, await request.get_json()))
        self.board.prefill_started(pd_id)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled.append(pd_id)
            raise
        if self.status != 200:
            kind = "invalid_request_error" if self.status < 500 else "server_error"
            return Response(json.dumps({"error": {"message": f"prefill says {self.status}", "type": kind,
                                                  "param": None, "code": None}}), self.status,
                            content_type="application/json")
        self.board.ship(kv, pd_id)
        return Response(json.dumps({"pd_id": pd_id, "prompt_tokens": 3, "kv_transfer_ms": 1.5}),
                        content_type="application/json")


def dying_decode(chunks_before_death: int):
    """A raw HTTP server that starts an SSE stream and drops the connection mid-way, as a killed
    decode instance would."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(chunks_before_death):
            data = chunk(f"w{i}")
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.transport.abort()
    return handle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def new_event() -> asyncio.Event:
    return asyncio.Event()
