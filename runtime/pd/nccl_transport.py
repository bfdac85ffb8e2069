"""KV transfer between GPUs through torch.distributed point-to-point (NCCL; gloo on CPU for tests).

One one-way link per (prefill rank, decode rank) pair in a process group both belong to. Each page is
two messages: a fixed-size header tensor (length-prefixed msgpack KvPageHeader/KvAbort), then the
payload, whose size the header gives. No replies: a NCCL communicator runs its sends and receives in
order on one stream, so a receive posted for an ack would block the next page's send. Hence a sender's
handle done means the peer took all bytes; whether they were accepted is the receiver's handle's
business. A link whose peer stops answering cannot be resynchronised: it is marked broken and every
transfer on it fails (recreate the group to recover).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import msgspec
import torch
import torch.distributed as dist

from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.pd.kv_transfer import (DTYPES, KvAbort, KvPageHeader, KvReceiver, KvSender, KvToReceiver,
                                            Page, SideStream, TransferHandle, check_header, compute_done_marker,
                                            gather_page, page_header, plan_pages, scatter_page)

HEADER_BYTES = 1024
_LINK_CLOSED = ""  # KvAbort with this request id: the sender closed the link
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KvToReceiver)


class LinkBroken(RuntimeError):
    pass


class _Link:
    """The peer, the group, the device the backend sends from, and waiting with a deadline."""

    def __init__(self, peer: int, group: Optional[dist.ProcessGroup], timeout_s: float):
        self.peer, self.group, self.timeout_s = peer, group, timeout_s
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.broken: Optional[str] = None

    def wait(self, work, what: str, timeout_s: Optional[float] = None) -> None:
        """Blocks: gloo's is_completed() never turns true for p2p, and its wait() may not be retried."""
        try:
            work.wait(timedelta(seconds=timeout_s or self.timeout_s))
        except RuntimeError as e:
            self.broken = f"{what}: rank {self.peer} did not answer within {timeout_s or self.timeout_s}s ({e})"
            raise LinkBroken(self.broken) from e

    def encode(self, msg) -> torch.Tensor:
        raw = _encoder.encode(msg)
        if len(raw) > HEADER_BYTES - 4:
            raise ValueError(f"header of {len(raw)} bytes exceeds {HEADER_BYTES - 4}")
        buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        buf[:4] = torch.frombuffer(bytearray(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
        buf[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return buf.to(self.device)

    @staticmethod
    def decode(buf: torch.Tensor):
        raw = buf.cpu().numpy().tobytes()
        return _decoder.decode(raw[4:4 + int.from_bytes(raw[:4], "little")])


# ---- prefill side -------------------------------------------------------------------------------


@dataclass
class _Outgoing:
    handle: TransferHandle
    slots: torch.Tensor
    kv: KvCache
    pages: list[Page]
    ready: object
    next_page: int = 0


class NcclKvSender(KvSender):
    """Sends to global rank `peer`; pages of concurrent transfers go out round-robin."""

    def __init__(self, peer: int, *, group: Optional[dist.ProcessGroup] = None, page_tokens: int = 256,
                 timeout_s: float = 30.0):
        self._link = _Link(peer, group, timeout_s)
        self.page_tokens = page_tokens
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = SideStream()
        self._thread = threading.Thread(target=self._run, name="kv-send-p2p", daemon=True)
        self._thread.start()

    def send(self, request_id: str, src_slots: list[int], kv: KvCache) -> TransferHandle:
        handle = TransferHandle(request_id)
        if not src_slots:
            handle.finish()
            return handle
        slots = torch.tensor(src_slots, dtype=torch.int64, device=kv.k[0].device)
        self._commands.put(_Outgoing(handle, slots, kv, plan_pages(len(src_slots), self.page_tokens),
                                     compute_done_marker(kv)))
        return handle

    def close(self) -> None:
        self._commands.put(None)
        self._thread.join()

    def _run(self) -> None:
        active: list[_Outgoing] = []
        closing = False
        while not closing or active:
            try:
                while True:  # block only when there is nothing to send
                    command = self._commands.get(block=not active and not closing, timeout=None)
                    if command is None:
                        closing = True
                    else:
                        active.append(command)
            except queue.Empty:
                pass
            for t in list(active):
                if self._link.broken is not None:
                    t.handle.finish(f"link to rank {self._link.peer} broken: {self._link.broken}")
                elif self._send_page(t):
                    if t.next_page < len(t.pages):
                        continue
                    t.handle.tokens_done = len(t.slots)
                    t.handle.finish()
                active.remove(t)
            if closing and not active:
                break
        if self._link.broken is None:
            try:  # lets the receiver stop listening instead of waiting on a receive forever
                self._link.wait(dist.isend(self._link.encode(KvAbort(_LINK_CLOSED, "sender closed")),
                                           dst=self._link.peer, group=self._link.group), "closing the link")
            except LinkBroken:
                pass

    def _send_page(self, t: _Outgoing) -> bool:
        """Sends the next page; False when the transfer ended with an error."""
        page = t.pages[t.next_page]
        try:
            header = page_header(t.handle.request_id, page, len(t.slots), t.kv)
            rows = t.slots[page.first_token:page.first_token + page.num_tokens]
            with self._stream.run(t.slots.device, t.ready):
                data = gather_page(t.kv, rows).to(self._link.device, non_blocking=True)
                header_buf = self._link.encode(header)
        except Exception as e:  # a bad slot or dtype, found before anything went out: this request only
            t.handle.finish(f"gathering page {page.index} failed: {e}")
            return False
        try:
            with self._stream.run(t.slots.device):
                sends = [dist.isend(header_buf, dst=self._link.peer, group=self._link.group),
                         dist.isend(data.view(torch.uint8).reshape(-1), dst=self._link.peer, group=self._link.group)]
            for work in sends:
                self._link.wait(work, f"sending page {page.index} of {t.handle.request_id}")
        except LinkBroken as e:
            t.handle.finish(str(e))
            return False
        t.next_page += 1
        t.handle.tokens_done = page.first_token + page.num_tokens
        return True


# ---- decode side --------------------------------------------------------------------------------


@dataclass
class _Incoming:
    handle: TransferHandle
    slots: torch.Tensor
    kv: KvCache
    last_progress: float = field(default_factory=time.monotonic)


class NcclKvReceiver(KvReceiver):
    """Receives from global rank `peer`. A wire thread blocks on the link and queues what arrives; the
    logic thread applies registrations and pages in order and ends idle transfers. Pages that come
    before `recv` registers their request are parked, up to `max_parked_bytes`; beyond that such a
    request fails (there is no back channel to stall the sender)."""

    IDLE_WAIT_S = 7 * 24 * 3600.0  # waiting for the next header is not a failure: links idle for long

    def __init__(self, peer: int, *, group: Optional[dist.ProcessGroup] = None, timeout_s: float = 30.0,
                 max_parked_bytes: int = 256 << 20, max_page_bytes: int = 1 << 30):
        self._link = _Link(peer, group, timeout_s)
        self.max_parked_bytes, self.max_page_bytes = max_parked_bytes, max_page_bytes
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # registrations and wire events, in order
        self._expected: dict[str, _Incoming] = {}
        self._parked: dict[str, list] = {}  # request id -> [(header, payload)]
        self._parked_bytes = 0
        self._failed: dict[str, str] = {}  # request id -> why, for pages/registrations that come later
        self._stream = SideStream()
        self._closing = threading.Event()
        self._wire = threading.Thread(target=self._read_wire, name="kv-wire-p2p", daemon=True)
        self._thread = threading.Thread(target=self._run, name="kv-recv-p2p", daemon=True)
        self._wire.start()
        self._thread.start()

    def recv(self, request_id: str, dst_slots: list[int], kv: KvCache) -> TransferHandle:
        handle = TransferHandle(request_id)
        if not dst_slots:
            handle.finish()
            return handle
        self._events.put(_Incoming(handle, torch.tensor(dst_slots, dtype=torch.int64, device=kv.k[0].device), kv))
        return handle

    def close(self) -> None:
        """Ends the logic thread; the wire thread ends when the sender closes the link (or at exit)."""
        self._closing.set()
        self._thread.join()

    def _read_wire(self) -> None:
        link = self._link
        try:
            while True:
                buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=link.device)
                link.wait(dist.irecv(buf, src=link.peer, group=link.group), "waiting for a header", self.IDLE_WAIT_S)
                msg = link.decode(buf)
                if isinstance(msg, KvAbort):
                    self._events.put(msg)
                    if msg.request_id == _LINK_CLOSED:
                        return
                    continue
                size = msg.payload_bytes
                if msg.dtype not in DTYPES or size <= 0 or size > self.max_page_bytes:
                    link.broken = f"page header of {msg.request_id} announces {size} bytes of {msg.dtype}"
                    raise LinkBroken(link.broken)
                payload = torch.empty(size, dtype=torch.uint8, device=link.device)
                link.wait(dist.irecv(payload, src=link.peer, group=link.group),
                          f"receiving page {msg.page} of {msg.request_id}")
                self._events.put((msg, payload))
        except LinkBroken as e:
            self._events.put(e)

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                event = self._events.get(timeout=0.05)
            except queue.Empty:
                event = None
            if isinstance(event, _Incoming):
                self._register(event)
            elif isinstance(event, tuple):
                self._on_page(*event)
            elif isinstance(event, KvAbort) and event.request_id == _LINK_CLOSED:
                self._link.broken = "the sender closed the link"
            elif isinstance(event, KvAbort):
                self._fail(event.request_id, f"prefill peer aborted the transfer: {event.reason}")
            if self._link.broken is not None:  # nothing more will come: fail what waits for it
                for t in list(self._expected.values()):
                    self._end(t, f"link to rank {self._link.peer} broken: {self._link.broken}")
            now = time.monotonic()
            for t in list(self._expected.values()):
                if now - t.last_progress > self._link.timeout_s:
                    self._end(t, f"no KV page from rank {self._link.peer} for {self._link.timeout_s}s")
        for t in list(self._expected.values()):
            self._end(t, "receiver closed")

    def _register(self, t: _Incoming) -> None:
        rid = t.handle.request_id
        if rid in self._expected:
            t.handle.finish(f"a transfer of {rid} is already expected on this receiver")
        elif rid in self._failed:
            t.handle.finish(self._failed.pop(rid))
        elif self._link.broken is not None and rid not in self._parked:
            t.handle.finish(f"link to rank {self._link.peer} broken: {self._link.broken}")
        else:
            self._expected[rid] = t
            for header, payload in self._parked.pop(rid, []):
                self._parked_bytes -= payload.numel()
                if rid in self._expected:  # an earlier parked page may have failed it
                    self._deliver(header, payload)

    def _on_page(self, header: KvPageHeader, payload: torch.Tensor) -> None:
        size = payload.numel()
        if header.request_id in self._expected:
            self._deliver(header, payload)
        elif header.request_id in self._failed:
            pass  # the rest of a transfer that already failed
        elif self._parked_bytes + size <= self.max_parked_bytes:
            self._parked.setdefault(header.request_id, []).append((header, payload))
            self._parked_bytes += size
        else:
            self._fail(header.request_id, "its KV came before recv() and the parking space was full")

    def _deliver(self, header: KvPageHeader, payload: torch.Tensor) -> None:
        t = self._expected[header.request_id]
        error = check_header(header, t.kv, len(t.slots), t.handle.tokens_done)
        if error is not None:
            self._end(t, error)
            return
        rows = t.slots[header.first_token:header.first_token + header.num_tokens]
        page = payload.view(DTYPES[header.dtype]).view(header.shape)
        with self._stream.run(t.slots.device):
            scatter_page(t.kv, rows, page.to(t.slots.device, non_blocking=True))
        t.handle.tokens_done += header.num_tokens
        t.last_progress = time.monotonic()
        if t.handle.tokens_done == len(t.slots):
            self._end(t, None)

    def _fail(self, request_id: str, reason: str) -> None:
        for _, payload in self._parked.pop(request_id, []):
            self._parked_bytes -= payload.numel()
        t = self._expected.get(request_id)
        if t is not None:
            self._end(t, reason)
        else:
            self._remember_failure(request_id, reason)

    def _end(self, t: _Incoming, error: Optional[str]) -> None:
        self._expected.pop(t.handle.request_id, None)
        if error is not None:
            self._remember_failure(t.handle.request_id, error)
        t.handle.finish(error)

    def _remember_failure(self, request_id: str, reason: str) -> None:
        self._failed[request_id] = reason
        if len(self._failed) > 4096:  # bounded: the oldest failures are long settled
            del self._failed[next(iter(self._failed))]
