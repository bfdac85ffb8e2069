"""The KV transfers of prefill/decode disaggregation, as the scheduler of one instance sees them.

Prefill/decode disaggregation (`pd_role`): a prefill instance runs the master's requests as
one-token requests, then sends the KV of every prompt token but the last to the decode instance
(SendKv) and ends them with `kv_sent` once it is acknowledged. A decode instance allocates slots for
those tokens (less the prefix its prompt cache holds), receives them (ReceiveKv), then admits the
request like a prompt-cache hit: only the last prompt token is computed, and the first output token
is sampled there, with the request's own seed and penalties. Requests holding KV without running
(transfers, received KV waiting for a row) count at their peak at admission.

`KvTransfers` keeps which requests wait for slots to receive into, which are moving, and the commands
for the worker; what a finished transfer does to its request (finished, failed, queued to run) is the
scheduler's, which owns the requests' lifecycle.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from llaunch.runtime.ipc.messages import CancelKv, ReceiveKv, SendKv
from llaunch.runtime.router.request import Request, Status


class KvTransfers:
    def __init__(self, cache):
        self.cache = cache  # the instance's prompt cache, which allocates its slots
        self.awaiting: deque[Request] = deque()  # decode instance: waiting for slots to receive into
        self.moving: dict[str, Request] = {}  # request id → request whose KV is being sent / received
        self.commands: list = []  # SendKv / ReceiveKv / CancelKv for the worker, taken by the router

    def admit(self, fits: Callable[[Request, int], bool]) -> None:
        """Decode instance: give waiting transfers their slots, FIFO, while `fits` (the scheduler's KV
        budget, with the request's cached prefix locked) allows."""
        while self.awaiting:
            req = self.awaiting[0]
            self.cache.lend(req)  # a prefix cached here is not written again
            if not fits(req, req.prompt_len):
                self.cache.take_back(req)
                return
            self.awaiting.popleft()
            new = self.cache.alloc(req.prompt_len - 1 - req.num_cached)
            req.slots = req.slots + new
            req.status = Status.TRANSFER
            self.moving[req.id] = req
            self.commands.append(ReceiveKv(request_id=req.id, pd_id=req.pd.id, slots=new, skip=req.num_cached))

    def send(self, req: Request) -> None:
        """Prefill instance: the prompt is computed; ship all of it but the last token."""
        req.status = Status.TRANSFER
        self.moving[req.id] = req
        self.commands.append(SendKv(request_id=req.id, pd_id=req.pd.id, slots=req.slots[: req.prompt_len - 1],
                                    address=req.pd.decode_kv))

    def cancel(self, req: Request) -> None:
        """A receive that no longer matters: its slots stay the worker's until its KvDone."""
        self.commands.append(CancelKv(request_id=req.id))

    def ended(self, request_id: str) -> Optional[Request]:
        """The request whose transfer a KvDone ends (None: not one of ours any more)."""
        return self.moving.pop(request_id, None)

    def held(self) -> list[Request]:
        """Requests whose KV is being received: they hold slots without a row."""
        return [r for r in self.moving.values() if r.row is None]

    def clear(self) -> None:
        self.awaiting.clear()
        self.moving.clear()
