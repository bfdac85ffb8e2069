"""Structured-output specs checked by compiling them in processes of their own, under a time budget.

xgrammar cannot cancel a compile, and some specs compile for minutes (`(a|b|...|h)*` repeated: 0.3 s at
450 characters, 10.9 s at 1,800, minutes at 18,000). A compile that ran on a thread held that thread
to the end, and the frontend's request parsing waited behind such threads. Here each compile runs in
one of a few processes forked from a forkserver that has imported xgrammar once (a fresh interpreter
takes ~10 s to import it); a compile over the budget, or one no client waits for any more, is ended
by killing its process, which is then replaced. The event loop never blocks: results come through
the processes' pipes (loop readers), processes start and are reaped on a thread of the pool's own.

`check(constraint)` answers None (it compiles), the reason it does not, or raises CompileTimeout (it
ran for the whole budget), CompileBusy (no process took it within the budget: others' compiles) or
CompileUnavailable (no process can start).
Verdicts are remembered per spec, timeouts included: the same spec sent again costs nothing.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from llaunch.runtime.ipc.messages import Constraint

log = logging.getLogger(__name__)

_VERDICTS = 512  # specs whose verdict is remembered
_TIMED_OUT = "timed out"  # a remembered verdict


class CompileTimeout(Exception):
    """The spec compiled for the whole budget without finishing."""


class CompileBusy(Exception):
    """No compile process took the spec within the budget."""


class CompileUnavailable(Exception):
    """No compile process can start (the tokenizer does not load): structured output cannot be served."""


class _Job:
    def __init__(self, constraint: Constraint, future: asyncio.Future):
        self.constraint = constraint
        self.future = future
        self.waiters = 0
        self.slot: Optional[_Slot] = None
        self.timer: Optional[asyncio.TimerHandle] = None


class _Slot:
    """One compile process: starting, then idle or running one job."""

    def __init__(self, index: int):
        self.index = index
        self.process = None
        self.conn = None
        self.ready = False
        self.starting = False  # a process is being started for it (on the pool's thread)
        self.job: Optional[_Job] = None


class CompilePool:
    def __init__(self, make_tokenizer: Callable[[], Any], vocab_size: int, budget_s: float, processes: int = 2):
        """`make_tokenizer`: a picklable factory of the Hugging Face tokenizer (each process loads it)."""
        self.make_tokenizer = make_tokenizer
        self.vocab_size = vocab_size
        self.budget_s = budget_s
        self._slots = [_Slot(i) for i in range(processes)]
        self._queue: deque[_Job] = deque()
        self._jobs: dict[Constraint, _Job] = {}
        self._verdicts: OrderedDict[Constraint, Optional[str]] = OrderedDict()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="grammar-processes")
        self._context = multiprocessing.get_context("forkserver")
        self._closed = False
        self.unavailable: Optional[str] = None  # why no process can start (the tokenizer does not load)
        self.warm = False  # a process was ready once (or none can be): the forkserver's start is over
        self._info_json: Optional[str] = None  # the tokenizer's vocabulary as the first process read it

    # ---- the requests' side -----------------------------------------------------------------------

    async def check(self, constraint: Constraint) -> Optional[str]:
        """None when the spec compiles, else why not; CompileTimeout, CompileBusy as the module says."""
        if constraint in self._verdicts:
            self._verdicts.move_to_end(constraint)
            verdict = self._verdicts[constraint]
            if verdict == _TIMED_OUT:
                raise CompileTimeout()
            return verdict
        if self._loop is None:
            self.start()
        if self.unavailable is not None:
            raise CompileUnavailable(self.unavailable)
        job = self._jobs.get(constraint)
        if job is None:
            job = self._jobs[constraint] = _Job(constraint, self._loop.create_future())
            self._queue.append(job)
            job.timer = self._loop.call_later(self.budget_s, self._expire_queued, job)
            self._dispatch()
        job.waiters += 1
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            job.waiters -= 1
            if job.waiters == 0 and not job.future.done():  # nobody waits: it costs nobody anything more
                self._abandon(job)
            raise

    def start(self) -> None:
        """Start the processes (from the loop that will call `check`; returns at once)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._replace(self._slots[0])  # the others once it is ready: they read its vocabulary, not the tokenizer

    def close(self) -> None:
        self._closed = True
        for slot in self._slots:
            self._stop(slot)
        for job in list(self._jobs.values()):
            if not job.future.done():
                job.future.cancel()
        self._starter.shutdown(wait=False)

    # ---- jobs ---------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        for slot in self._slots:
            if not self._queue:
                return
            if slot.ready and slot.job is None:
                job = self._queue.popleft()
                job.timer.cancel()
                job.slot, slot.job = slot, job
                try:
                    slot.conn.send(job.constraint)
                except OSError:  # the process just died: its reader reports it
                    pass
                job.timer = self._loop.call_later(self.budget_s, self._expire, job)

    def _finish(self, job: _Job, verdict: Optional[str], remember: bool = True) -> None:
        if job.timer is not None:
            job.timer.cancel()
        self._jobs.pop(job.constraint, None)
        if remember:
            self._verdicts[job.constraint] = verdict
            if len(self._verdicts) > _VERDICTS:
                self._verdicts.popitem(last=False)
        if not job.future.done():
            if verdict == _TIMED_OUT:
                job.future.set_exception(CompileTimeout())
            else:
                job.future.set_result(verdict)

    def _expire(self, job: _Job) -> None:
        """The budget ran out while it compiled: end the process, remember the spec as too slow."""
        log.warning("a %s spec did not compile within %g s (server.max_constraint_compile_s): its process is "
                    "ended", job.constraint.kind, self.budget_s)
        slot = job.slot
        self._finish(job, _TIMED_OUT)
        if slot is not None:
            slot.job = None
            self._replace(slot)
        self._dispatch()

    def _expire_queued(self, job: _Job) -> None:
        if job in self._queue:
            self._queue.remove(job)
            self._jobs.pop(job.constraint, None)
            if not job.future.done():
                job.future.set_exception(CompileBusy())

    def _abandon(self, job: _Job) -> None:
        """Every client of the job left: drop it from the queue, or end the process compiling it."""
        if job.timer is not None:
            job.timer.cancel()
        self._jobs.pop(job.constraint, None)
        job.future.cancel()
        if job in self._queue:
            self._queue.remove(job)
        elif job.slot is not None:
            log.info("a %s compile nobody waits for is abandoned: its process is ended", job.constraint.kind)
            job.slot.job = None
            self._replace(job.slot)
            self._dispatch()

    # ---- processes ----------------------------------------------------------------------------------

    def _replace(self, slot: _Slot) -> None:
        """End the slot's process (if any) and start another, off the loop."""
        old = self._stop(slot)
        if not self._closed:
            slot.starting = True
            self._starter.submit(self._start_process, slot, old)

    def _stop(self, slot: _Slot):
        old, slot.ready = slot.process, False
        if slot.conn is not None:
            self._loop.remove_reader(slot.conn.fileno())
            slot.conn.close()
        slot.process = slot.conn = None
        if old is not None and old.is_alive():
            old.kill()
        return old

    def _start_process(self, slot: _Slot, old) -> None:
        """On the pool's thread: reap the old process, fork a new one from the forkserver (the first
        start launches the forkserver, which imports xgrammar once)."""
        if old is not None:
            old.join()
        if self._closed:
            return
        try:
            self._context.set_forkserver_preload(["xgrammar", "llaunch.runtime.constrained.compile_process"])
            parent, child = self._context.Pipe()
            from llaunch.runtime.constrained.compile_process import serve_compiles

            args = (child, self.make_tokenizer, self.vocab_size, self._info_json)
            process = self._context.Process(target=serve_compiles, args=args, name=f"grammar-compile-{slot.index}",
                                            daemon=True)
            process.start()
            child.close()
        except Exception as e:  # noqa: BLE001: any failure leaves structured output unavailable
            if self._closed:  # the frontend stopped meanwhile (its forkserver with it)
                return
            log.exception("a grammar compile process could not start")
            self._loop.call_soon_threadsafe(self._unavailable, f"{type(e).__name__}: {e}")
            return
        self._loop.call_soon_threadsafe(self._started, slot, process, parent)

    def _started(self, slot: _Slot, process, conn) -> None:
        slot.starting = False
        if self._closed or slot.process is not None:
            process.kill()
            conn.close()
            return
        slot.process, slot.conn = process, conn
        self._loop.add_reader(conn.fileno(), self._on_message, slot)

    def _unavailable(self, reason: str) -> None:
        self.unavailable, self.warm = reason, True
        while self._queue:
            job = self._queue.popleft()
            job.timer.cancel()
            self._jobs.pop(job.constraint, None)
            if not job.future.done():
                job.future.set_exception(CompileUnavailable(reason))

    def _on_message(self, slot: _Slot) -> None:
        try:
            kind, payload = slot.conn.recv()
        except (EOFError, OSError):
            job, slot.job = slot.job, None
            log.error("grammar compile process %d exited%s", slot.index, " while compiling" if job else "")
            if job is not None:
                self._finish(job, "the grammar compiler's process exited while compiling it", remember=False)
            self._replace(slot)
            return
        if kind == "ready":
            slot.ready = self.warm = True
            if self._info_json is None:  # the first: later processes read its vocabulary instead of the tokenizer
                self._info_json = payload
                for other in self._slots:
                    if other.process is None and not other.starting:
                        self._replace(other)
        elif kind == "failed":  # the tokenizer does not load: no process ever will
            log.error("grammar compile processes cannot start: %s", payload)
            self._stop(slot)
            self._unavailable(payload)
            return
        elif slot.job is not None and slot.job.constraint == payload[0]:
            job, slot.job = slot.job, None
            self._finish(job, payload[1])
        self._dispatch()
