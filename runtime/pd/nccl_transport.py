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
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import msgspec
import torch
import torch.distributed as dist

from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.pd.kv_landing import KvLanding
from llaunch.runtime.pd.kv_transfer import (DTYPES, KvAbort, KvReceiver, KvSender, KvToReceiver, Page, SideStream,
                                            TransferHandle, compute_done_marker, gather_page, page_header,
                                            plan_pages)

HEADER_BYTES = 1024
LINK_CLOSED = ""  # KvAbort with this request id: the sender closed the link
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KvToReceiver)


class LinkBroken(RuntimeError):
    pass


def encode_frame(msg, device: torch.device) -> torch.Tensor:
    """A header or abort as a fixed-size tensor: 4 bytes of length, then msgpack."""
    raw = _encoder.encode(msg)
    if len(raw) > HEADER_BYTES - 4:
        raise ValueError(f"header of {len(raw)} bytes exceeds {HEADER_BYTES - 4}")
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[:4] = torch.frombuffer(bytearray(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    buf[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def decode_frame(buf: torch.Tensor) -> KvToReceiver:
    raw = buf.cpu().numpy().tobytes()
    return _decoder.decode(raw[4:4 + int.from_bytes(raw[:4], "little")])


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
        return encode_frame(msg, self.device)


# ---- prefill side -------------------------------------------------------------------------------


@dataclass
class Outgoing:
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
        slots = torch.tensor(src_slots, dtype=torch.int64)  # moved to the device on the side stream
        self._commands.put(Outgoing(handle, slots, kv, plan_pages(len(src_slots), self.page_tokens),
                                     compute_done_marker(kv)))
        return handle

    def close(self) -> None:
        self._commands.put(None)
        self._thread.join()

    def _run(self) -> None:
        active: list[Outgoing] = []
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
                self._link.wait(dist.isend(self._link.encode(KvAbort(LINK_CLOSED, "sender closed")),
                                           dst=self._link.peer, group=self._link.group), "closing the link")
            except LinkBroken:
                pass

    def _send_page(self, t: Outgoing) -> bool:
        """Sends the next page; False when the transfer ended with an error."""
        page = t.pages[t.next_page]
        try:
            header = page_header(t.handle.request_id, page, len(t.slots), t.kv)
            rows = t.slots[page.first_token:page.first_token + page.num_tokens]
            with self._stream.run(t.kv.k[0].device, t.ready):
                data = gather_page(t.kv, rows.to(t.kv.k[0].device, non_blocking=True))
                data = data.to(self._link.device, non_blocking=True)
                header_buf = self._link.encode(header)
        except Exception as e:  # a bad slot or dtype, found before anything went out: this request only
            t.handle.finish(f"gathering page {page.index} failed: {e}")
            return False
        try:
            with self._stream.run(t.kv.k[0].device):
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


class NcclKvReceiver(KvReceiver):
    """Receives from global rank `peer`. A wire thread blocks on the link and hands what arrives to a
    KvLanding (link 0), whose logic thread writes pages, parks early ones (up to `max_parked_bytes`;
    beyond that such a request fails: there is no back channel to stall the sender) and ends idle
    transfers."""

    IDLE_WAIT_S = 7 * 24 * 3600.0  # waiting for the next header is not a failure: links idle for long

    def __init__(self, peer: int, *, group: Optional[dist.ProcessGroup] = None, timeout_s: float = 30.0,
                 max_parked_bytes: int = 256 << 20, max_page_bytes: int = 1 << 30):
        self._link = _Link(peer, group, timeout_s)
        self.max_page_bytes = max_page_bytes
        self._landing = KvLanding(timeout_s, max_parked_bytes=max_parked_bytes, single_link=True,
                                  name="kv-recv-p2p")
        self._wire = threading.Thread(target=self._read_wire, name="kv-wire-p2p", daemon=True)
        self._wire.start()

    def recv(self, request_id: str, dst_slots: list[int], kv: KvCache) -> TransferHandle:
        return self._landing.register(request_id, dst_slots, kv)

    def cancel(self, request_id: str) -> None:
        """Stop writing pages of `request_id` (its slots are about to be freed); its handle fails."""
        self._landing.cancel(request_id)

    def close(self) -> None:
        """Ends the logic thread; the wire thread ends when the sender closes the link (or at exit)."""
        self._landing.close()

    def _read_wire(self) -> None:
        link = self._link
        try:
            while True:
                buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=link.device)
                link.wait(dist.irecv(buf, src=link.peer, group=link.group), "waiting for a header", self.IDLE_WAIT_S)
                msg = decode_frame(buf)
                if isinstance(msg, KvAbort) and msg.request_id == LINK_CLOSED:
                    self._landing.link_down(0, "the sender closed the link")
                    return
                if isinstance(msg, KvAbort):
                    self._landing.abort(0, msg.request_id, msg.reason)
                    continue
                size = msg.payload_bytes
                if msg.dtype not in DTYPES or size <= 0 or size > self.max_page_bytes:
                    link.broken = f"page header of {msg.request_id} announces {size} bytes of {msg.dtype}"
                    raise LinkBroken(link.broken)
                payload = torch.empty(size, dtype=torch.uint8, device=link.device)
                link.wait(dist.irecv(payload, src=link.peer, group=link.group),
                          f"receiving page {msg.page} of {msg.request_id}")
                self._landing.page(0, msg, payload)
        except LinkBroken as e:
            self._landing.link_down(0, f"link to rank {link.peer} broken: {e}")
