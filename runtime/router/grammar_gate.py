"""Requests wait here, outside the scheduler, until their grammar is compiled on every worker rank, so a
step never waits for a grammar (a 1,000-property JSON schema takes seconds to compile).

The first request with a constraint the workers have not compiled sends them PrepareConstraints; each
rank answers ConstraintsReady when its compile is done, and once every rank has, the held requests go
to the scheduler (or fail with the compile's error). Constraints known to be compiled go straight
through: the router remembers the last READY_ENTRIES of them, fewer than the workers' compile cache
holds (runtime/constrained/compiler.py), so a remembered one is still compiled there. Pure logic: no
sockets.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from llaunch.runtime.ipc.messages import Constraint, ConstraintsReady
from llaunch.runtime.router.request import Request

READY_ENTRIES = 256  # < the workers' _CACHE_ENTRIES (512)


class GrammarGate:
    def __init__(self, ranks: int):
        self.ranks = ranks
        self._ready: OrderedDict[Constraint, None] = OrderedDict()
        self._held: dict[Constraint, list[Request]] = {}  # constraint → requests waiting for it, in order
        self._reports: dict[Constraint, list[Optional[str]]] = {}  # constraint → the ranks' errors so far
        self.to_prepare: list[Constraint] = []  # for the router to send the workers (PrepareConstraints)

    def __len__(self) -> int:
        return sum(len(reqs) for reqs in self._held.values())

    def hold(self, req: Request) -> bool:
        """Whether `req` must wait for its grammar (then it is held here); the first request of a
        constraint puts it on `to_prepare`."""
        c = req.sampling.constraint
        if c is None or c in self._ready:
            return False
        if c not in self._held:
            self.to_prepare.append(c)
        self._held.setdefault(c, []).append(req)
        return True

    def on_ready(self, msg: ConstraintsReady) -> tuple[list[Request], list[tuple[Request, str]]]:
        """One rank's report: the requests now free to run, and those whose grammar failed (with why)."""
        released, failed = [], []
        for c, error in zip(msg.constraints, msg.errors):
            reports = self._reports.setdefault(c, [])
            reports.append(error)
            if len(reports) < self.ranks:
                continue
            del self._reports[c]
            error = next((e for e in reports if e is not None), None)
            waiting = self._held.pop(c, [])
            if error is None:
                self._ready[c] = None
                self._ready.move_to_end(c)
                while len(self._ready) > READY_ENTRIES:
                    self._ready.popitem(last=False)
                released += waiting
            else:
                failed += [(r, error) for r in waiting]
        return released, failed

    def abort(self, request_id: str) -> Optional[Request]:
        for c, reqs in self._held.items():
            for r in reqs:
                if r.id == request_id:
                    reqs.remove(r)
                    return r
        return None

    def take_all(self) -> list[Request]:
        """Every held request (the replica is failing them all)."""
        out = [r for reqs in self._held.values() for r in reqs]
        self._held.clear()
        return out
