"""KV transfer over ZMQ/TCP: works on CPU (CI) and across hosts without NCCL.

The decode side binds a ROUTER (ZmqKvReceiver); each prefill instance connects a DEALER
(ZmqKvSender). A page goes out as two frames, [KvPageHeader, raw bytes]; the receiver answers every
page with KvAck or the request with KvNack. Acks give flow control (at most `window` unacknowledged
pages per request, so staging memory is bounded) and tell the sender the KV has landed. Each side
owns its socket in one background thread; the caller only enqueues work and waits on handles.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import msgspec
import torch
import zmq

from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.kv_transfer.pages import (KvAbort, KvPageHeader, KvReceiver, KvSender, KvToReceiver, Page,
                                               SideStream, TransferHandle, check_header, compute_done_marker,
                                               from_wire, gather_page, page_header, plan_pages, scatter_page,
                                               to_wire)

log = logging.getLogger(__name__)


class KvAck(msgspec.Struct, array_like=True, tag=True, frozen=True):
    request_id: str
    page: int


class KvNack(msgspec.Struct, array_like=True, tag=True, frozen=True):
    request_id: str
    reason: str


KvToSender = Union[KvAck, KvNack]
_encoder = msgspec.msgpack.Encoder()
_POLL_MS = 50  # how often an idle IO thread checks timeouts


class _IoThread:
    """A socket owned by one thread; other threads hand it work through a queue and a wake-up pipe."""

    def __init__(self, socket: zmq.Socket, name: str):
        self.socket = socket
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, command) -> None:
        self.commands.put(command)
        os.write(self._wake_w, b"x")

    def stop(self) -> None:
        self._closing.set()
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                events = dict(poller.poll(_POLL_MS))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                while not self.commands.empty():
                    self._guarded(self.on_command, self.commands.get())
                while self.socket.poll(0):
                    self._guarded(self.on_message, self.socket.recv_multipart(copy=False))
                self.on_tick(time.monotonic())
        finally:
            self.on_close()
            self.socket.close(0)

    def _guarded(self, handler, arg) -> None:
        try:
            handler(arg)
        except Exception:  # one bad message must not stop the transport for every other request
            log.exception("%s: handling %s failed", self._thread.name, type(arg).__name__)

    def on_command(self, command) -> None: ...
    def on_message(self, frames: list) -> None: ...
    def on_tick(self, now: float) -> None: ...
    def on_close(self) -> None: ...


# ---- prefill side -------------------------------------------------------------------------------


@dataclass
class _Outgoing:
    handle: TransferHandle
    slots: torch.Tensor
    kv: KvCache
    pages: list[Page]
    ready: object  # CUDA event after the KV's compute, or None
    next_page: int = 0
    acked: int = 0
    last_progress: float = field(default_factory=time.monotonic)


class ZmqKvSender(KvSender, _IoThread):
    def __init__(self, address: str, *, page_tokens: int = 256, window: int = 4, timeout_s: float = 30.0,
                 ctx: Optional[zmq.Context] = None):
        self._ctx = ctx or zmq.Context.instance()
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)  # the window bounds what is queued, not the socket
        socket.connect(address)
        _IoThread.__init__(self, socket, "kv-send")
        self.address, self.page_tokens, self.window, self.timeout_s = address, page_tokens, window, timeout_s
        self._active: dict[str, _Outgoing] = {}
        self._stream = SideStream()
        self.start()

    def send(self, request_id: str, src_slots: list[int], kv: KvCache) -> TransferHandle:
        handle = TransferHandle(request_id)
        if not src_slots:  # a full prefix hit on the decode side: nothing to move
            handle.finish()
            return handle
        slots = torch.tensor(src_slots, dtype=torch.int64)  # moved to the device on the side stream
        self.submit(_Outgoing(handle, slots, kv, plan_pages(len(src_slots), self.page_tokens),
                              compute_done_marker(kv)))
        return handle

    def close(self) -> None:
        self.stop()

    def on_command(self, t: _Outgoing) -> None:
        if t.handle.request_id in self._active:
            t.handle.finish(f"a transfer of {t.handle.request_id} is already running on this sender")
            return
        t.last_progress = time.monotonic()
        self._active[t.handle.request_id] = t

    def on_message(self, frames: list) -> None:
        try:
            msg = msgspec.msgpack.decode(frames[0].buffer, type=KvToSender)
        except msgspec.ValidationError as e:
            log.error("kv sender %s: undecodable reply dropped: %s", self.address, e)
            return
        t = self._active.get(msg.request_id)
        if t is None:
            return  # a late reply for a transfer that already ended
        if isinstance(msg, KvNack):
            self._end(t, f"decode peer rejected the transfer: {msg.reason}")
            return
        t.acked += 1
        t.handle.tokens_done = t.pages[t.acked - 1].first_token + t.pages[t.acked - 1].num_tokens
        t.last_progress = time.monotonic()
        if t.acked == len(t.pages):
            self._end(t, None)

    def on_tick(self, now: float) -> None:
        for t in list(self._active.values()):
            while t.next_page < len(t.pages) and t.next_page - t.acked < self.window:
                if not self._send_page(t):
                    break
            if now - t.last_progress > self.timeout_s:
                self._end(t, f"no acknowledgement from the decode peer at {self.address} for {self.timeout_s}s")

    def on_close(self) -> None:
        for t in list(self._active.values()):
            self._end(t, "sender closed")

    def _send_page(self, t: _Outgoing) -> bool:
        page = t.pages[t.next_page]
        try:
            header = page_header(t.handle.request_id, page, len(t.slots), t.kv)
            rows = t.slots[page.first_token:page.first_token + page.num_tokens]
            with self._stream.run(t.kv.k[0].device, t.ready):
                data = gather_page(t.kv, rows.to(t.kv.k[0].device, non_blocking=True)).to("cpu", non_blocking=True)
        except Exception as e:  # a bad slot or dtype fails this request only
            self._end(t, f"gathering page {page.index} failed: {e}")
            return False
        try:
            self.socket.send_multipart([_encoder.encode(header), to_wire(data)], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False  # the peer's queue is full: retried on the next tick
        t.next_page += 1
        return True

    def _end(self, t: _Outgoing, error: Optional[str]) -> None:
        self._active.pop(t.handle.request_id, None)
        if error is not None and t.next_page > t.acked:  # pages in flight: tell the receiver now
            self._try_send([_encoder.encode(KvAbort(t.handle.request_id, error))])
        t.handle.finish(error)

    def _try_send(self, frames: list) -> None:
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # best effort: the peer's timeout covers a lost abort


# ---- decode side --------------------------------------------------------------------------------


@dataclass
class _Incoming:
    handle: TransferHandle
    slots: torch.Tensor
    kv: KvCache
    peer: Optional[bytes] = None  # the sender's DEALER identity, once a page came
    last_progress: float = field(default_factory=time.monotonic)


@dataclass
class _Cancel:
    request_id: str


@dataclass
class _Parked:
    """Pages that came before `recv` registered their request (at most a window's worth)."""

    since: float
    pages: list = field(default_factory=list)  # (peer, header, payload frame)


class ZmqKvReceiver(KvReceiver, _IoThread):
    def __init__(self, address: str, *, timeout_s: float = 30.0, max_parked_requests: int = 64,
                 ctx: Optional[zmq.Context] = None):
        self._ctx = ctx or zmq.Context.instance()
        socket = self._ctx.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone peer raises instead of vanishing
        socket.bind(address)
        _IoThread.__init__(self, socket, "kv-recv")
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)  # resolves "tcp://host:*"
        self.timeout_s, self.max_parked_requests = timeout_s, max_parked_requests
        self._expected: dict[str, _Incoming] = {}
        self._parked: dict[str, _Parked] = {}
        self._failed: dict[str, float] = {}  # request id -> when it failed: its late pages are dropped
        self._stream = SideStream()
        self.start()

    def recv(self, request_id: str, dst_slots: list[int], kv: KvCache) -> TransferHandle:
        handle = TransferHandle(request_id)
        if not dst_slots:
            handle.finish()
            return handle
        self.submit(_Incoming(handle, torch.tensor(dst_slots, dtype=torch.int64), kv))
        return handle

    def cancel(self, request_id: str) -> None:
        """Stop writing pages of `request_id` (its slots are about to be freed); its handle fails."""
        self.submit(_Cancel(request_id))

    def close(self) -> None:
        self.stop()

    def on_command(self, t) -> None:
        if isinstance(t, _Cancel):
            self._parked.pop(t.request_id, None)
            incoming = self._expected.get(t.request_id)
            if incoming is not None:
                self._end(incoming, "cancelled by the decode instance (request ended)")
            return
        rid = t.handle.request_id
        if rid in self._expected:
            t.handle.finish(f"a transfer of {rid} is already expected on this receiver")
            return
        t.last_progress = time.monotonic()
        self._expected[rid] = t
        parked = self._parked.pop(rid, None)
        for peer, header, payload in parked.pages if parked else []:
            if rid in self._expected:  # an earlier parked page may have failed it
                self._on_page(peer, header, payload)

    def on_message(self, frames: list) -> None:
        peer = frames[0].bytes
        try:
            msg = msgspec.msgpack.decode(frames[1].buffer, type=KvToReceiver)
        except (msgspec.ValidationError, msgspec.DecodeError, IndexError) as e:
            log.error("kv receiver %s: undecodable message dropped: %s", self.address, e)
            return
        if isinstance(msg, KvAbort):
            self._parked.pop(msg.request_id, None)
            t = self._expected.get(msg.request_id)
            if t is not None:
                self._end(t, f"prefill peer aborted the transfer: {msg.reason}")
            return
        payload = frames[2] if len(frames) == 3 else None
        if msg.request_id in self._failed:  # its sender may not know yet (say, it started late)
            self._reply(peer, KvNack(msg.request_id, "the receiver already failed this transfer"))
            return
        if msg.request_id in self._expected:
            self._on_page(peer, msg, payload)
        elif msg.request_id in self._parked or len(self._parked) < self.max_parked_requests:
            self._parked.setdefault(msg.request_id, _Parked(time.monotonic())).pages.append((peer, msg, payload))
        else:
            self._reply(peer, KvNack(msg.request_id, f"receiver holds {self.max_parked_requests} "
                                                     "unregistered transfers already"))

    def on_tick(self, now: float) -> None:
        for t in list(self._expected.values()):
            if now - t.last_progress > self.timeout_s:
                self._end(t, f"no KV page from the prefill peer for {self.timeout_s}s")
        for rid, parked in list(self._parked.items()):
            if now - parked.since > self.timeout_s:
                del self._parked[rid]
                self._reply(parked.pages[0][0], KvNack(rid, f"no recv() registered within {self.timeout_s}s"))
        for rid, when in list(self._failed.items()):
            if now - when > self.timeout_s:
                del self._failed[rid]

    def on_close(self) -> None:
        for t in list(self._expected.values()):
            self._end(t, "receiver closed")

    def _on_page(self, peer: bytes, header: KvPageHeader, payload) -> None:
        t = self._expected[header.request_id]
        t.peer = peer
        error = check_header(header, t.kv, len(t.slots), t.handle.tokens_done)
        if error is None and (payload is None or len(payload.buffer) != header.payload_bytes):
            error = f"page {header.page} carries {len(payload.buffer) if payload else 0} bytes, " \
                    f"header says {header.payload_bytes}"
        if error is not None:
            self._end(t, error)
            return
        rows = t.slots[header.first_token:header.first_token + header.num_tokens]
        with self._stream.run(t.kv.k[0].device):
            device = t.kv.k[0].device
            scatter_page(t.kv, rows.to(device, non_blocking=True),
                         from_wire(payload.buffer, header).to(device, non_blocking=True))
        t.handle.tokens_done += header.num_tokens
        t.last_progress = time.monotonic()
        self._reply(peer, KvAck(header.request_id, header.page))
        if t.handle.tokens_done == len(t.slots):
            self._end(t, None)

    def _end(self, t: _Incoming, error: Optional[str]) -> None:
        self._expected.pop(t.handle.request_id, None)
        if error is not None:
            self._failed[t.handle.request_id] = time.monotonic()
            if t.peer is not None:
                self._reply(t.peer, KvNack(t.handle.request_id, error))
        t.handle.finish(error)

    def _reply(self, peer: bytes, msg: Union[KvAck, KvNack]) -> None:
        try:
            self.socket.send_multipart([peer, _encoder.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the sender is gone or stalled: its own timeout ends its side
