"""Typed one-way ZMQ sockets: a PULL that binds and decodes exactly one message union, a PUSH that
connects and encodes. One socket per edge of the process graph.

A frame that does not decode as the socket's union (a stray or malformed message: anyone who can
reach the socket can send one) is logged and dropped, never fatal: the receiver waits for the next."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Generic, Optional, Type, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
log = logging.getLogger(__name__)
_BAD_FRAME_LOG_EVERY_S = 10.0


class _Decoding(Generic[T]):
    """Decode frames as one type; count and log (at most every few seconds) those that do not."""

    def __init__(self, msg_type: Type[T] | Any, address: str):
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self.address = address
        self.dropped = 0
        self._logged_at = float("-inf")

    def decode(self, frame) -> Optional[T]:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.dropped += 1
            now = time.monotonic()
            if now - self._logged_at >= _BAD_FRAME_LOG_EVERY_S:
                self._logged_at = now
                log.warning("%s: dropped a frame that is not a message of this socket (%d so far): %s",
                            self.address, self.dropped, str(e)[:200])
            return None


def _prepare_ipc(address: str) -> None:
    if address.startswith("ipc://"):
        os.makedirs(os.path.dirname(address[len("ipc://"):]) or ".", exist_ok=True)


class Receiver(Generic[T]):
    """PULL socket bound at `address`; `recv` returns a decoded `T` (a Struct or a Union of them)."""

    def __init__(self, ctx: zmq.Context, address: str, msg_type: Type[T] | Any,
                 monitor: Optional["SocketMonitor"] = None):
        """`monitor`: attached before the bind, so no peer's connection can come before it."""
        _prepare_ipc(address)
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        if monitor is not None:
            self.socket.monitor(monitor.address, monitor.events)
        self.socket.bind(address)
        self.address = address
        self._decoding = _Decoding(msg_type, address)

    @property
    def dropped(self) -> int:
        return self._decoding.dropped

    def decode(self, frame: bytes) -> Optional[T]:
        return self._decoding.decode(frame)

    def recv(self, timeout_ms: Optional[int] = None) -> Optional[T]:
        """Block up to timeout_ms (None: forever); None when nothing (valid) arrived in time."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            wait = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if wait is not None and not self.socket.poll(wait):
                return None
            msg = self._decoding.decode(self.socket.recv(copy=False).buffer)
            if msg is not None or (deadline is not None and time.monotonic() >= deadline):
                return msg

    def recv_nowait(self) -> Optional[T]:
        while True:
            try:
                msg = self._decoding.decode(self.socket.recv(zmq.NOBLOCK, copy=False).buffer)
            except zmq.Again:
                return None
            if msg is not None:
                return msg

    def close(self) -> None:
        self.socket.close(0)


class SocketMonitor:
    """The connection events of a socket this process binds (a ZMQ socket monitor), for a watcher
    thread to read. Its reader connects before the monitor exists and the monitor is attached before
    the bind (Receiver(monitor=...)), so no event is lost, not even a peer's first connection."""

    def __init__(self, ctx: zmq.Context, name: str, events: int):
        self.address = f"inproc://monitor-{name}"
        self.events = events
        self._reader = ctx.socket(zmq.PAIR)
        self._reader.connect(self.address)  # inproc may connect before the bind

    def recv(self) -> tuple[int, int]:
        """(event kind, its value: the connection's fd), blocking; call from one thread only."""
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(self._reader)
        return event["event"], event["value"]


class Sender:
    """PUSH socket connected to `address`."""

    def __init__(self, ctx: zmq.Context, address: str):
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 500)  # let the last messages out at exit, briefly: peers may be gone
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop: the graph's queues are bounded upstream
        self.socket.connect(address)
        self.address = address

    def send(self, msg: Any) -> None:
        self.socket.send(_encoder.encode(msg), copy=False)

    def close(self) -> None:
        self.socket.close()


class AsyncReceiver(Generic[T]):
    """PULL socket for asyncio code (the HTTP frontend)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, msg_type: Type[T] | Any):
        _prepare_ipc(address)
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self._decoding = _Decoding(msg_type, address)

    async def recv(self) -> T:
        while True:
            frame = await self.socket.recv(copy=False)
            msg = self._decoding.decode(frame.buffer)
            if msg is not None:
                return msg

    def close(self) -> None:
        self.socket.close(0)


class AsyncSender:
    def __init__(self, ctx: zmq.asyncio.Context, address: str):
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.connect(address)

    async def send(self, msg: Any) -> None:
        await self.socket.send(_encoder.encode(msg), copy=False)

    def close(self) -> None:
        self.socket.close()
