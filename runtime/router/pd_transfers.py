"""The scheduler's side of prefill/decode disaggregation (a mixin of runtime/router/scheduler.py's
Scheduler, whose state it uses: `awaiting_kv`, `transfers`, `kv_commands`, `waiting`, the KV allocator
and the prompt cache).

Prefill/decode disaggregation (`pd_role`): a prefill instance runs the master's requests as
one-token requests, then sends the KV of every prompt token but the last to the decode instance
(SendKv) and ends them with `kv_sent` once it is acknowledged. A decode instance allocates slots for
those tokens (less the prefix its prompt cache holds), receives them (ReceiveKv), then admits the
request like a prompt-cache hit: only the last prompt token is computed, and the first output token
is sampled here, with the request's own seed and penalties. Requests holding KV without running
(transfers, received KV waiting for a row) count at their peak at admission.
"""
from __future__ import annotations

from llaunch.runtime.ipc.messages import KvDone, ReceiveKv, SendKv, TokenDelta
from llaunch.runtime.router.request import Request, Status


class PdTransfers:
    def admit_transfers(self) -> None:
        """Decode instance: give waiting transfers their slots, FIFO, while the KV budget allows."""
        while self.awaiting_kv:
            req = self.awaiting_kv[0]
            self.cache.lend(req)  # a prefix cached here is not written again
            if not self._kv_fits(req, req.prompt_len):
                self.cache.take_back(req)
                return
            self.awaiting_kv.popleft()
            new = self.cache.alloc(req.prompt_len - 1 - req.num_cached)
            req.slots = req.slots + new
            req.status = Status.TRANSFER
            self.transfers[req.id] = req
            self.kv_commands.append(ReceiveKv(request_id=req.id, pd_id=req.pd.id, slots=new, skip=req.num_cached))

    def _send_kv(self, req: Request) -> None:
        """Prefill instance: the prompt is computed; ship all of it but the last token."""
        req.status = Status.TRANSFER
        self.transfers[req.id] = req
        self.kv_commands.append(SendKv(request_id=req.id, pd_id=req.pd.id, slots=req.slots[: req.prompt_len - 1],
                                       address=req.pd.decode_kv))

    def on_kv_done(self, msg: KvDone) -> list[TokenDelta]:
        req = self.transfers.pop(msg.request_id, None)
        if req is None:
            return []
        if req.row is not None:  # prefill side: the slots may be cached or freed now
            if req.status is Status.FINISHED:  # aborted while sending
                if req.steps_in_flight == 0:
                    self._release(req)
                return []
            delta = self._finish(req, "kv_sent" if msg.error is None else "error")
            delta.kv_transfer_ms = msg.seconds * 1000
            return [delta]
        if msg.error is not None or req.status is Status.FINISHED:
            self.kv.free(req.slots[req.num_cached:])  # never filled: not for the prompt cache
            req.slots = req.slots[: req.num_cached]
            if req.status is Status.FINISHED:
                self.cache.release(req)
                return []
            return [self._finish(req, "error")]
        req.num_computed = req.prompt_len - 1
        req.kv_ready = True
        req.status = Status.WAITING
        self.waiting.appendleft(req)  # it has waited for its KV already
        return []

    def _holding(self, candidate: Request) -> list[Request]:
        """Requests holding KV without running: transfers, and received KV waiting for a row."""
        held = [r for r in self.transfers.values() if r.row is None and r is not candidate]
        return held + [r for r in self.waiting if r.kv_ready and r is not candidate]
