"""The worker's end of prefill/decode disaggregation: starts the KV transfers the router asks for
(SendKv on a prefill instance, ReceiveKv / CancelKv on a decode instance) on the transport the
decode address names (tcp:// ZMQ through host memory, nccl:// GPU to GPU), and
reports each one's end as a KvDone. The transport's threads move the pages; the serve loop only polls."""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from llaunch.runtime.ipc.messages import CancelKv, KvDone, ReceiveKv, SendKv
from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.kv_transfer.pages import TransferHandle
from llaunch.runtime.kv_transfer.zmq_transport import ZmqKvReceiver, ZmqKvSender

log = logging.getLogger(__name__)
MAX_REPAIRS = 3  # new pairs per decode address after a broken one



class KvTransportStuck(RuntimeError):
    """A NCCL operation of this process missed its deadline: the GPU's other streams may stall behind
    it, so the worker must exit at once (see runtime/worker/process.py)."""

class KvLink:
    def __init__(self, kv: KvCache, receive_address: Optional[str], scratch_slot: int, tp_rank: int = 0,
                 timeout_s: float = 30.0):
        self.kv = kv
        self.tp_rank = tp_rank  # rank r sends its KV heads to the decode instance's rank r
        self.scratch_slot = scratch_slot  # where pages of a prefix this instance has cached already go
        self.timeout_s = timeout_s
        self.receiver = _receiver(receive_address, kv, timeout_s) if receive_address else None
        self.senders: dict[str, ZmqKvSender] = {}  # decode instance address → sender
        self.repairs: dict[str, int] = {}  # decode address → broken senders replaced so far
        self.active: dict[str, tuple[TransferHandle, float]] = {}  # request id → (handle, start)
        self.pd_ids: dict[str, str] = {}  # request id → transfer id

    @property
    def busy(self) -> bool:
        return bool(self.active)

    def start(self, msg) -> None:
        if isinstance(msg, CancelKv):
            if self.receiver is not None and msg.request_id in self.pd_ids:
                self.receiver.cancel(self.pd_ids[msg.request_id])
            return
        if isinstance(msg, SendKv):
            ranks = msg.address.split(",")  # the decode instance's ranks, in order
            if len(ranks) <= self.tp_rank:
                handle = TransferHandle(msg.pd_id)
                handle.finish(f"the decode instance has {len(ranks)} tensor-parallel rank(s), this prefill "
                              f"instance more: both need the same parallel.tp")
            else:
                address = ranks[self.tp_rank]
                sender = self.senders.get(address)
                if (sender is not None and getattr(sender, "broken", None)
                        and self.repairs.get(address, 0) < MAX_REPAIRS):
                    # The decode rank restarted or the join failed: pair again rather than fail every
                    # later request to this address. Bounded: a NCCL pair's buffers are never freed
                    # (pair_group._retire). Its close can wait on its thread: not here.
                    self.repairs[address] = self.repairs.get(address, 0) + 1
                    log.warning("KV sender %s is broken (%s): pairing again (%d of %d)", address, sender.broken,
                                self.repairs[address], MAX_REPAIRS)
                    threading.Thread(target=sender.close, name=f"close-{address}", daemon=True).start()
                    sender = None
                if sender is None:
                    sender = self.senders[address] = _sender(address, self.kv, self.timeout_s)
                handle = sender.send(msg.pd_id, msg.slots, self.kv)
        elif isinstance(msg, ReceiveKv):
            if self.receiver is None:
                handle = TransferHandle(msg.pd_id)
                handle.finish("this instance receives no KV (mode is not pd_decode)")
            else:
                handle = self.receiver.recv(msg.pd_id, [self.scratch_slot] * msg.skip + msg.slots, self.kv)
        else:
            raise TypeError(f"not a KV transfer command: {type(msg).__name__}")
        self.active[msg.request_id] = (handle, time.perf_counter())
        self.pd_ids[msg.request_id] = msg.pd_id

    def check(self) -> None:
        """Raises when a NCCL transport is stuck (a peer died inside a NCCL operation: the GPU cannot
        form new pairs and its other streams may stall), so the worker exits and the instance
        restarts instead of hanging."""
        for transport in [self.receiver, *self.senders.values()]:
            stuck = getattr(transport, "stuck", None)
            if stuck:
                raise KvTransportStuck(f"KV transport stuck, this instance must restart: {stuck}")

    def poll(self) -> list[KvDone]:
        """Transfers that ended since the last poll (after `check`)."""
        self.check()
        done = []
        for request_id, (handle, start) in list(self.active.items()):
            if handle.done():
                del self.active[request_id]
                self.pd_ids.pop(request_id, None)
                done.append(KvDone(request_id=request_id, error=handle.error, seconds=time.perf_counter() - start))
        return done

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        if self.receiver is not None:
            self.receiver.close()


def _receiver(address: str, kv: KvCache, timeout_s: float):
    """The transport is the address's scheme: tcp:// ZMQ, nccl:// a NCCL pair group per sender."""
    if address.startswith("nccl://"):
        from llaunch.runtime.kv_transfer.nccl_pairing import NCCL_PARKING_BYTES, PairedKvReceiver

        # on a GPU the parking space is reserved in the KV sizing; on CPU the default keeps tests small
        parking = NCCL_PARKING_BYTES if kv.k[0].device.type == "cuda" else 256 << 20
        return PairedKvReceiver(address, kv.k[0].device, timeout_s=timeout_s, max_parked_bytes=parking)
    return ZmqKvReceiver(address, timeout_s=timeout_s)


def _sender(address: str, kv: KvCache, timeout_s: float):
    if address.startswith("nccl://"):
        from llaunch.runtime.kv_transfer.nccl_pairing import PairedKvSender

        return PairedKvSender(address, kv.k[0].device, timeout_s=timeout_s)
    return ZmqKvSender(address, timeout_s=timeout_s)
