"""The control connection of a KV pair (see pair_group): length-prefixed msgpack frames over one TCP
connection, from the prefill rank to the decode rank (hello, page headers, aborts) and back once
(the welcome). A plain socket, so a reader blocks in Python, not in a torch call, and closing the
socket ends it."""
from __future__ import annotations

import contextlib
import socket
import struct
from typing import Union

import msgspec

from llaunch.runtime.kv_transfer.pages import KvAbort, KvPageHeader

LINK_CLOSED = ""  # KvAbort with this request id: the sender closed the link


class LinkBroken(RuntimeError):
    """A pair's link cannot go on: a half-done exchange cannot be resynchronised."""


_MAX_FRAME = 1 << 16


class PairHello(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """The first frame on a control connection: which pair it is and who is on the other end."""

    n: int
    who: str


class PairWelcome(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """The decode rank's answer to a hello, before any NCCL work: go ahead, or why not."""

    refused: str = ""


ControlFrame = Union[KvPageHeader, KvAbort, PairHello, PairWelcome]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlFrame)


class ControlSocket:
    """Length-prefixed msgpack frames over one TCP connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a header must not wait for more bytes
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def send(self, frame: ControlFrame) -> None:
        raw = _encoder.encode(frame)
        self.sock.sendall(struct.pack(">I", len(raw)) + raw)

    def recv(self) -> ControlFrame:
        (size,) = struct.unpack(">I", self._exactly(4))
        if size > _MAX_FRAME:
            raise LinkBroken(f"a control frame of {size} bytes: the stream is corrupt")
        return _decoder.decode(self._exactly(size))

    def shutdown(self) -> None:
        """Ends a recv() blocked in another thread (it sees end of stream)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        self.sock.close()

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise LinkBroken("the peer closed the control connection")
            got += k
        return bytes(buf)
