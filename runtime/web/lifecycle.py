"""An HTTP app's life after start (the frontend's, the pd_master's): serving, draining (SIGTERM: refuse
new work, let running requests finish within a bound) and stopping (what Hypercorn's shutdown trigger
waits for)."""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

log = logging.getLogger(__name__)


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0  # generation requests whose response is not fully sent
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = asyncio.Event()
        self._asked = asyncio.Event()  # drain or stop was asked
        self._drain_timeout: Optional[float] = None

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests from now on; stop once the running ones finish or `timeout_s` passes."""
        if not self.draining:
            log.info("draining: %d requests in flight, waiting up to %.0f s", self.in_flight, timeout_s)
            self.draining = True
            self._drain_timeout = timeout_s
            self._asked.set()

    @property
    def stopping_now(self) -> bool:
        return self._stop.is_set()

    def stop_now(self) -> None:
        self.draining = True
        self._stop.set()
        self._asked.set()

    async def wait_drained(self) -> bool:
        """Block until a drain or stop was asked and the drain has ended; False if it timed out."""
        await self._asked.wait()
        stop = asyncio.ensure_future(self._stop.wait())
        idle = asyncio.ensure_future(self._idle.wait())
        done, pending = await asyncio.wait({stop, idle}, timeout=self._drain_timeout,
                                           return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if not done:
            log.warning("drain timed out with %d requests in flight", self.in_flight)
        return bool(done)
