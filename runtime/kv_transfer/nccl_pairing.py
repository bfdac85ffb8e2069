"""KV transfer between two separately launched instances over NCCL (gloo on CPU), with no process
group in common: the decode rank's PairedKvReceiver hosts a store at nccl://host:port, and every
prefill rank that opens a PairedKvSender to it joins as pair n (see pair_group). Each page is a header
on the pair's control connection, then its bytes on the pair's data group.

No replies: a sender's handle done means the peer took all the bytes; whether
they were accepted is the receiver's handle's business. A broken link fails only the transfers it
carried; a sender whose link broke stays broken (open a new one to rejoin).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch

from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.kv_transfer.kv_landing import KvLanding
from llaunch.runtime.kv_transfer.pages import (DTYPES, KvAbort, KvPageHeader, KvReceiver, KvSender, Page, SideStream,
                                               TransferError, TransferHandle, compute_done_marker, gather_page,
                                               page_header, plan_pages)
from llaunch.runtime.kv_transfer.pair_control import LINK_CLOSED, LinkBroken
from llaunch.runtime.kv_transfer.pair_group import (JoinError, JoinSteps, PairLink, host_pairing, join_as_receiver,
                                                    join_as_sender, join_overdue, parse_address, stuck_reason)

log = logging.getLogger(__name__)

_GiB = 1 << 30
# A NCCL pair communicator holds ~0.8 GiB of buffers on each side: room for two peers (each further
# peer comes out of what cache.mem_fraction leaves), plus the decode side's parking space for pages
# that arrive before their request does. The worker's KV sizing reserves both.
NCCL_PAIR_RESERVE = 2 * _GiB
NCCL_PARKING_BYTES = 1 * _GiB


def _use_device(device: torch.device) -> None:
    if device.type == "cuda":  # a new thread starts on GPU 0
        torch.cuda.set_device(device)


# ---- prefill side -------------------------------------------------------------------------------


@dataclass
class Outgoing:
    """One transfer in the sender thread: its pages, the next to send, the event its KV waits on."""
    handle: TransferHandle
    slots: torch.Tensor
    kv: KvCache
    pages: list[Page]
    ready: object
    next_page: int = 0


class PairedKvSender(KvSender):
    """Joins the decode rank at `address` in the background (send() never blocks; transfers queue until
    the join is done), then sends pages of concurrent transfers round-robin from one thread. A join
    that fails, or takes longer than `join_timeout_s`, fails every transfer with the step it stopped at."""

    def __init__(self, address: str, device: Union[torch.device, str], *, timeout_s: float = 30.0,
                 page_tokens: int = 256, join_timeout_s: Optional[float] = None):
        parse_address(address)  # a malformed address fails here, in the caller
        self.address, self.device = address, torch.device(device)
        self.timeout_s, self.page_tokens = timeout_s, page_tokens
        self.join_timeout_s = join_timeout_s or 3 * timeout_s
        self.link: Optional[PairLink] = None
        self.broken: Optional[str] = None
        self._lock = threading.Lock()  # orders send() against breaking
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._joined = threading.Event()  # set once the join ended, either way
        self._steps = JoinSteps(f"KV sender {address} from {self.device}")
        self._stream = SideStream()
        self._timer = threading.Timer(self.join_timeout_s, self._join_overdue)
        self._timer.daemon = True
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{address}", daemon=True)
        self._thread.start()
        self._timer.start()

    def send(self, request_id: str, src_slots: list[int], kv: KvCache) -> TransferHandle:
        handle = TransferHandle(request_id)
        if not src_slots:  # a full prefix hit on the decode side: nothing to move
            handle.finish()
            return handle
        # kept on the host: a host→device copy here would wait for the step in flight (see _send_page)
        slots = torch.tensor(src_slots, dtype=torch.int64)
        with self._lock:
            if self.broken is not None:
                handle.finish(f"KV link to {self.address} broken: {self.broken}")
            else:
                self._commands.put(Outgoing(handle, slots, kv, plan_pages(len(src_slots), self.page_tokens),
                                            compute_done_marker(kv)))
        return handle

    @property
    def stuck(self) -> Optional[str]:
        """Set once a NCCL operation of this process on this GPU missed its deadline: the instance
        should report itself unhealthy and be restarted (the operation cannot be aborted)."""
        return stuck_reason(self.device)

    def wait_joined(self, timeout: Optional[float] = None) -> None:
        """Raises TransferError unless the link is up within `timeout` seconds."""
        if not self._joined.wait(timeout):
            raise TransferError(self._steps.describe())
        if self.broken is not None:
            raise TransferError(self.broken)

    def close(self) -> None:
        """Sends what is queued, tells the receiver, ends the control connection (a NCCL group is kept
        until the process exits: see pair_group._retire)."""
        self._commands.put(None)
        # bounded either way: a thread stuck in NCCL must not hold the worker's shutdown forever
        self._thread.join(self.timeout_s if self._joined.is_set() else self.join_timeout_s)
        self._timer.cancel()
        if self._thread.is_alive():
            log.error("closing %s: the sender thread is still busy, %s", self.address, self._steps.describe())

    def _run(self) -> None:
        _use_device(self.device)
        try:
            link = join_as_sender(self.address, self.device, self.timeout_s, self._steps)
        except JoinError as e:
            self._break(str(e))
            return
        with self._lock:
            overdue = self.broken is not None
            if not overdue:
                self.link = link
        self._joined.set()
        self._timer.cancel()
        if overdue:  # the join finished after the transfers waiting on it were failed
            link.close()
            return
        self._serve(link)
        if self.broken is None:
            try:  # lets the receiver end the link now instead of on a socket error
                link.send_control(KvAbort(LINK_CLOSED, "sender closed"), "closing the link")
            except LinkBroken:
                pass
        link.close()

    def _serve(self, link: PairLink) -> None:
        active: list[Outgoing] = []
        closing = False
        while not closing or active:
            try:
                while True:  # block only when there is nothing to send
                    command = self._commands.get(block=not active and not closing)
                    if command is None:
                        closing = True
                    else:
                        active.append(command)
            except queue.Empty:
                pass
            try:
                for t in list(active):
                    if self.broken is not None:
                        t.handle.finish(f"KV link to {self.address} broken: {self.broken}")
                    elif self._send_page(link, t):
                        if t.next_page < len(t.pages):
                            continue
                        t.handle.tokens_done = len(t.slots)
                        t.handle.finish()
                    active.remove(t)
            except LinkBroken as e:
                self._break(str(e))
                for t in active:
                    t.handle.finish(f"KV link to {self.address} broken: {e}")
                active = []

    def _send_page(self, link: PairLink, t: Outgoing) -> bool:
        """Sends the next page; False when the transfer ended with an error. Raises LinkBroken."""
        page, rid = t.pages[t.next_page], t.handle.request_id
        try:
            header = page_header(rid, page, len(t.slots), t.kv)
            rows = t.slots[page.first_token:page.first_token + page.num_tokens]
            device = t.kv.k[0].device
            with self._stream.run(device, t.ready):
                data = gather_page(t.kv, rows.to(device, non_blocking=True)).to(link.device, non_blocking=True)
        except Exception as e:  # a bad slot or dtype: this request only
            error = f"gathering page {page.index} failed: {e}"
            t.handle.finish(error)
            if t.next_page > 0:  # the receiver holds part of it: fail it there now, not at its timeout
                link.send_control(KvAbort(rid, error), f"aborting {rid}")
            return False
        link.send_control(header, f"sending the header of page {page.index} of {rid}")
        link.send_data(data, f"sending page {page.index} of {rid}")
        t.next_page += 1
        t.handle.tokens_done = page.first_token + page.num_tokens
        return True

    def _join_overdue(self) -> None:
        with self._lock:
            if self.link is not None or self.broken is not None:
                return
        join_overdue(self._steps, self.device, self.timeout_s)
        self._break(f"{self._steps.describe()} (join timeout {self.join_timeout_s}s)")

    def _break(self, reason: str) -> None:
        """From now on every transfer fails with `reason`, the queued ones too."""
        with self._lock:
            if self.broken is None:
                self.broken = reason
                log.error("KV sender %s: %s", self.address, reason)
            drained = []
            while True:
                try:
                    drained.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if None in drained:
                self._commands.put(None)  # a close() that was waiting stays seen
        self._joined.set()
        for t in drained:
            if t is not None:
                t.handle.finish(f"KV link to {self.address} broken: {self.broken}")


# ---- decode side --------------------------------------------------------------------------------


class PairedKvReceiver(KvReceiver):
    """One per decode worker rank. Hosts the store and control listener prefill ranks join through
    (port 0: any free port; `.address` is what to advertise). Every joined link has a wire thread that
    hands pages to one KvLanding, which writes them. A link that breaks fails only what it carried."""

    def __init__(self, address: str, device: Union[torch.device, str], *, timeout_s: float = 30.0,
                 max_parked_bytes: int = 256 << 20, max_page_bytes: int = 1 << 30,
                 join_timeout_s: Optional[float] = None):
        self._host, port = parse_address(address)
        self.device = torch.device(device)
        self.timeout_s, self.max_page_bytes = timeout_s, max_page_bytes
        self.join_timeout_s = join_timeout_s or 3 * timeout_s
        self._store, self._listener = host_pairing(self._host, port, self.device, timeout_s)
        self._port = self._store.port
        self.address = f"nccl://{self._host}:{self._port}"
        self._landing = KvLanding(timeout_s, max_parked_bytes=max_parked_bytes, name="kv-recv-pairs")
        self._states: dict[int, str] = {}  # pair n -> "ready: ..." / "down: ..."
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()  # of live links, shut down by close()
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="kv-pair-accept", daemon=True)
        self._acceptor.start()

    def recv(self, request_id: str, dst_slots: list[int], kv: KvCache) -> TransferHandle:
        return self._landing.register(request_id, dst_slots, kv)

    def cancel(self, request_id: str) -> None:
        """Stop writing pages of `request_id` (its slots are about to be freed); its handle fails."""
        self._landing.cancel(request_id)

    @property
    def stuck(self) -> Optional[str]:
        """See PairedKvSender.stuck. While set, new prefill ranks are refused."""
        return stuck_reason(self.device)

    def link_states(self) -> dict[int, str]:
        return dict(self._states)

    def close(self) -> None:
        """Stops taking joiners, ends every link (their senders see the connection close) and the
        landing; waits for the wire threads, at most for one page's timeout."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        self._acceptor.join()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            threads = list(self._threads)
        deadline = time.monotonic() + self.timeout_s + 1
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.error("KV receiver %s: %s did not end", self.address, thread.name)
        self._landing.close()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if not self._closing.is_set():
                    log.error("KV receiver %s: accepting a joiner failed: %s", self.address, e)
                    time.sleep(0.1)
                continue
            thread = threading.Thread(target=self._serve_link, args=(conn,), name="kv-pair", daemon=True)
            with self._lock:
                if self._closing.is_set():
                    conn.close()
                    return
                self._connections.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve_link(self, conn: socket.socket) -> None:
        _use_device(self.device)
        steps = JoinSteps(f"KV receiver {self.address}")
        timer = threading.Timer(self.join_timeout_s, lambda: (log.error("%s", steps.describe()),
                                                              join_overdue(steps, self.device, self.timeout_s)))
        timer.daemon = True
        timer.start()
        try:
            link = join_as_receiver(self._host, self._port, conn, self.device, self.timeout_s, steps)
        except JoinError as e:
            log.error("%s", e)
            self._forget(conn)
            return
        finally:
            timer.cancel()
        self._states[link.n] = f"ready: {link.peer}"
        try:
            reason = self._read_pages(link)
        except Exception as e:  # LinkBroken, or a bug: either way this link is over
            reason = "this receiver closed" if self._closing.is_set() else str(e)
            if not self._closing.is_set():
                log.warning("KV receiver %s: pair %d down: %s", self.address, link.n, reason)
        self._states[link.n] = f"down: {reason}"
        self._landing.link_down(link.n, reason)
        link.close()
        self._forget(conn)

    def _read_pages(self, link: PairLink) -> str:
        """Hands every page of the link to the landing; returns why the link ended cleanly."""
        while True:
            msg = link.recv_control("waiting for a header")
            if isinstance(msg, KvAbort) and msg.request_id == LINK_CLOSED:
                return "the prefill rank closed the link"
            if isinstance(msg, KvAbort):
                self._landing.abort(link.n, msg.request_id, msg.reason)
                continue
            if not isinstance(msg, KvPageHeader):
                raise LinkBroken(f"unexpected {type(msg).__name__} on the control connection")
            size = msg.payload_bytes
            if msg.dtype not in DTYPES or size <= 0 or size > self.max_page_bytes:
                raise LinkBroken(f"page header of {msg.request_id} announces {size} bytes of {msg.dtype}")
            self._landing.page(link.n, msg, link.recv_data(size, f"receiving page {msg.page} of {msg.request_id}"))

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)
