"""Typed one-way ZMQ sockets: a PULL that binds and decodes exactly one message union, a PUSH that
connects and encodes. One socket per edge of the process graph."""
from __future__ import annotations

import os
from typing import Any, Generic, Optional, Type, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def _prepare_ipc(address: str) -> None:
    if address.startswith("ipc://"):
        os.makedirs(os.path.dirname(address[len("ipc://"):]) or ".", exist_ok=True)


class Receiver(Generic[T]):
    """PULL socket bound at `address`; `recv` returns a decoded `T` (a Struct or a Union of them)."""

    def __init__(self, ctx: zmq.Context, address: str, msg_type: Type[T] | Any):
        _prepare_ipc(address)
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = address
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    def decode(self, frame: bytes) -> T:
        return self._decoder.decode(frame)

    def recv(self, timeout_ms: Optional[int] = None) -> Optional[T]:
        """Block up to timeout_ms (None: forever); None when nothing arrived."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self._decoder.decode(self.socket.recv(copy=False).buffer)

    def recv_nowait(self) -> Optional[T]:
        try:
            return self._decoder.decode(self.socket.recv(zmq.NOBLOCK, copy=False).buffer)
        except zmq.Again:
            return None

    def close(self) -> None:
        self.socket.close(0)


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
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    async def recv(self) -> T:
        frame = await self.socket.recv(copy=False)
        return self._decoder.decode(frame.buffer)

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
