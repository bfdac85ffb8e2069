"""The router's watch over its workers (the seed's health monitor): a step that does not come back
within router.stall_timeout_s is a stall (a worker hung in a kernel); a worker whose connection to
the router drops is gone (a node that stopped: on node 0 the launcher sees local deaths itself).
Either way the replica reports itself stalled, so /health/ready fails and frontends send it nothing;
router.on_stall=exit also ends the router with EXIT_STALLED, so the launcher tears the graph down
and exits non-zero for a supervisor to restart it."""
from __future__ import annotations

import logging
import threading
from typing import Optional

import zmq

from llaunch.runtime.ipc.sockets import SocketMonitor

log = logging.getLogger("llaunch.router")
EXIT_STALLED = 4  # launcher/supervise.py names it


class EngineHealth:
    def __init__(self, stall_timeout_s: float):
        self.stall_timeout_s = stall_timeout_s
        self.stalled = False  # now: a step is overdue, or a worker is gone
        self.stalls = 0  # since start
        self.gone: Optional[str] = None  # set (once) by WorkerWatch's thread
        self._gone_seen = False

    def check_step(self, step: int, waited_s: float) -> bool:
        """The oldest step in flight has been out `waited_s`; True when that just became a stall."""
        if self.stalled or waited_s <= self.stall_timeout_s:
            return False
        self.stalled, self.stalls = True, self.stalls + 1
        log.error("engine stalled: step %d not back after %.0f s (router.stall_timeout_s=%g)", step, waited_s,
                  self.stall_timeout_s)
        return True

    def step_returned(self) -> None:
        if self.stalled and self.gone is None:
            log.warning("engine recovered: the overdue step came back")
            self.stalled = False

    def check_workers(self) -> bool:
        """True when a worker was just found gone."""
        if self.gone is None or self._gone_seen:
            return False
        self._gone_seen = True
        if not self.stalled:
            self.stalls += 1
        self.stalled = True
        log.error("engine stalled: %s", self.gone)
        return True


class WorkerWatch:
    """Follows the connections to the router's results socket (its monitor): a worker connection
    that completed its handshake and then drops means that worker is gone."""

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

    def __init__(self, ctx: zmq.Context, health: EngineHealth):
        self.health = health
        self.monitor = SocketMonitor(ctx, "worker-watch", self.EVENTS)  # give it to the results socket's Receiver

    def start(self) -> None:
        threading.Thread(target=self._run, name="worker-watch", daemon=True).start()

    def _run(self) -> None:
        accepted, workers = None, set()  # a handshake event carries no fd: it completes the last accepted one
        while True:
            kind, fd = self.monitor.recv()
            if kind == zmq.EVENT_ACCEPTED:
                accepted = fd
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED and accepted is not None:
                workers.add(accepted)
            elif kind == zmq.EVENT_DISCONNECTED and fd in workers:
                self.health.gone = "a worker's connection to the router dropped (its process or node stopped)"
                return
