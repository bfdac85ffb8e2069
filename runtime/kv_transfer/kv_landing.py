"""The decode side's bookkeeping for KV that arrives over torch.distributed links: which slots each
request's pages go to, pages that came before `recv` (parked, bounded), header checks, the scatter into
the cache, cancel, and failing exactly the transfers a broken link carried.

Wire threads (one per link) only enqueue events; one logic thread applies them in arrival order, so
the pages of one link are applied in the order they came and a cancel is ordered against them.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.kv_transfer.pages import DTYPES, KvPageHeader, SideStream, TransferHandle, check_header, scatter_page

log = logging.getLogger(__name__)
_TICK_S = 0.05  # how often an idle logic thread checks timeouts
_MAX_FAILED = 4096  # failed request ids remembered (so their late pages are dropped); the oldest go first


@dataclass
class _Incoming:
    handle: TransferHandle
    slots: torch.Tensor
    kv: KvCache
    link: Optional[int] = None  # the link its pages come over, once one came
    last_progress: float = field(default_factory=time.monotonic)


@dataclass
class _Parked:
    link: int
    since: float
    pages: list = field(default_factory=list)  # [(header, payload)]
    nbytes: int = 0


@dataclass(frozen=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True)
class _Page:
    link: int
    header: KvPageHeader
    payload: torch.Tensor  # uint8, on the link's device


@dataclass(frozen=True)
class _Abort:
    link: int
    request_id: str
    reason: str


@dataclass(frozen=True)
class _LinkDown:
    link: int
    reason: str


class KvLanding:
    """Transfers not yet heard from wait when a link goes down: another link may carry them."""

    def __init__(self, timeout_s: float, *, max_parked_bytes: int = 256 << 20, name: str = "kv-landing"):
        self.timeout_s, self.max_parked_bytes = timeout_s, max_parked_bytes
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._expected: dict[str, _Incoming] = {}
        self._parked: dict[str, _Parked] = {}
        self._parked_bytes = 0
        self._failed: dict[str, str] = {}  # request id -> why
        self._down: dict[int, str] = {}  # link -> why
        self._stream = SideStream()
        self._closing = threading.Event()
        self._handlers = {_Incoming: self._register, _Cancel: self._cancel, _Page: self._on_page,
                          _Abort: self._on_abort, _LinkDown: self._on_link_down}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- any thread ----

    def register(self, request_id: str, dst_slots: list[int], kv: KvCache) -> TransferHandle:
        handle = TransferHandle(request_id)
        if not dst_slots:
            handle.finish()
            return handle
        # kept on the host: a host→device copy here would wait for the step in flight (see _deliver)
        self._events.put(_Incoming(handle, torch.tensor(dst_slots, dtype=torch.int64), kv))
        return handle

    def cancel(self, request_id: str) -> None:
        self._events.put(_Cancel(request_id))

    def page(self, link: int, header: KvPageHeader, payload: torch.Tensor) -> None:
        self._events.put(_Page(link, header, payload))

    def abort(self, link: int, request_id: str, reason: str) -> None:
        self._events.put(_Abort(link, request_id, reason))

    def link_down(self, link: int, reason: str) -> None:
        self._events.put(_LinkDown(link, reason))

    def close(self) -> None:
        self._closing.set()
        # bounded: on a GPU whose NCCL receive is stuck, this thread's scatter can block behind it
        self._thread.join(self.timeout_s + 1)
        if self._thread.is_alive():
            log.error("KV landing %s: its thread is still busy after %.0fs", self._thread.name, self.timeout_s + 1)

    # ---- the logic thread ----

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                event = self._events.get(timeout=_TICK_S)
            except queue.Empty:
                event = None
            if event is not None:
                try:
                    self._handlers[type(event)](event)
                except Exception:  # one bad event must not stop landing for every other request
                    log.exception("kv landing: handling %s failed", type(event).__name__)
            self._check_timeouts(time.monotonic())
        for t in list(self._expected.values()):
            self._end(t, "receiver closed")

    def _register(self, t: _Incoming) -> None:
        rid = t.handle.request_id
        if rid in self._expected:
            t.handle.finish(f"a transfer of {rid} is already expected on this receiver")
            return
        if rid in self._failed:
            t.handle.finish(self._failed.pop(rid))
            return
        self._expected[rid] = t
        parked = self._parked.pop(rid, None)
        if parked is not None:
            self._parked_bytes -= parked.nbytes
            for header, payload in parked.pages:
                if rid in self._expected:  # an earlier parked page may have failed it
                    self._deliver(parked.link, header, payload)
        if rid in self._expected:  # not complete: can more still come?
            if t.link in self._down:
                self._end(t, f"link {t.link} went down before the transfer completed: {self._down[t.link]}")

    def _cancel(self, c: _Cancel) -> None:
        self._drop_parked(c.request_id)
        t = self._expected.get(c.request_id)
        reason = "cancelled by the decode instance (request ended)"
        if t is not None:
            self._end(t, reason)
        else:
            self._remember_failure(c.request_id, reason)

    def _on_page(self, p: _Page) -> None:
        rid = p.header.request_id
        if rid in self._expected:
            self._deliver(p.link, p.header, p.payload)
        elif rid in self._failed:
            pass  # the rest of a transfer that already failed or was cancelled
        elif rid in self._parked and self._parked[rid].link != p.link:
            self._fail(rid, f"pages of {rid} came over links {self._parked[rid].link} and {p.link}")
        elif self._parked_bytes + p.payload.numel() <= self.max_parked_bytes:
            parked = self._parked.setdefault(rid, _Parked(p.link, time.monotonic()))
            parked.pages.append((p.header, p.payload))
            parked.nbytes += p.payload.numel()
            self._parked_bytes += p.payload.numel()
        else:
            self._fail(rid, f"its KV came before recv() and the parking space ({self.max_parked_bytes} bytes) was full")

    def _on_abort(self, a: _Abort) -> None:
        self._fail(a.request_id, f"prefill peer aborted the transfer: {a.reason}")

    def _on_link_down(self, d: _LinkDown) -> None:
        self._down[d.link] = d.reason
        for t in list(self._expected.values()):
            if t.link == d.link:
                self._end(t, f"KV link {d.link} down: {d.reason}")
        # parked pages stay: a transfer that was sent whole before its link closed is still good

    def _deliver(self, link: int, header: KvPageHeader, payload: torch.Tensor) -> None:
        t = self._expected[header.request_id]
        error = check_header(header, t.kv, len(t.slots), t.handle.tokens_done)
        if error is None and t.link is not None and t.link != link:
            error = f"page {header.page} came over link {link}, the earlier pages over link {t.link}"
        if error is None and payload.numel() != header.payload_bytes:
            error = f"page {header.page} carries {payload.numel()} bytes, header says {header.payload_bytes}"
        if error is not None:
            self._end(t, error)
            return
        t.link = link
        rows = t.slots[header.first_token:header.first_token + header.num_tokens]
        page = payload.view(DTYPES[header.dtype]).view(header.shape)
        device = t.kv.k[0].device
        with self._stream.run(device):
            scatter_page(t.kv, rows.to(device, non_blocking=True), page.to(device, non_blocking=True))
        t.handle.tokens_done += header.num_tokens
        t.last_progress = time.monotonic()
        if t.handle.tokens_done == len(t.slots):
            self._end(t, None)

    def _check_timeouts(self, now: float) -> None:
        for t in list(self._expected.values()):
            if now - t.last_progress > self.timeout_s:
                source = f"link {t.link}" if t.link is not None else "any prefill peer"
                self._end(t, f"no KV page from {source} for {self.timeout_s}s")
        for rid, parked in list(self._parked.items()):
            if now - parked.since > self.timeout_s:
                self._fail(rid, f"its KV came over link {parked.link} but no recv() was registered within "
                                f"{self.timeout_s}s")

    def _fail(self, request_id: str, reason: str) -> None:
        self._drop_parked(request_id)
        t = self._expected.get(request_id)
        if t is not None:
            self._end(t, reason)
        else:
            self._remember_failure(request_id, reason)

    def _drop_parked(self, request_id: str) -> None:
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            self._parked_bytes -= parked.nbytes

    def _end(self, t: _Incoming, error: Optional[str]) -> None:
        self._expected.pop(t.handle.request_id, None)
        if error is not None:
            self._remember_failure(t.handle.request_id, error)
        t.handle.finish(error)

    def _remember_failure(self, request_id: str, reason: str) -> None:
        self._failed[request_id] = reason
        if len(self._failed) > _MAX_FAILED:
            del self._failed[next(iter(self._failed))]
