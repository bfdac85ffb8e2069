"""Continuous batching: each step runs every decoding request, continues chunked prefills and admits
waiting requests FIFO while the token budget, the row limit and the KV budget allow.

Admission never over-commits KV: a request is admitted only if the peak KV of all running requests
plus it, each run to its max_new_tokens, fits (LightLLM's estimate: sort by tokens left to generate;
when the i-th longest finishes, the i+1 longest each hold their cached tokens plus that many more;
the peak is the largest of these sums).
Allocation during decode therefore cannot fail. Pure logic: no sockets, no tensors.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, StepPlan, StepResult, TokenDelta
from llaunch.runtime.router.request import Request, Status


@dataclass(frozen=True)
class SchedulerLimits:
    kv_slots: int
    max_running: int
    batch_max_tokens: int
    chunked_prefill: bool
    chunked_prefill_size: int
    max_wait_tokens: int  # decode steps between admissions while requests decode
    token_ratio: float  # below this KV usage, admit every step regardless of max_wait_tokens
    max_model_len: int
    eos_ids: tuple[int, ...]


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.kv = KvAllocator(limits.kv_slots)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # row → request
        self.by_id: dict[str, Request] = {}
        self._free_rows = list(range(limits.max_running - 1, -1, -1))
        self._release_rows: list[int] = []
        self._step = 0
        self._steps_since_admit = 0
        self._in_flight: Optional[list[tuple[int, bool]]] = None  # (row, samples) of the step out
        self._deferred_aborts: list[str] = []

    # ---- requests in -----------------------------------------------------------------------

    def add(self, req: Request) -> Optional[TokenDelta]:
        """Queue a request; one that could never fit the KV cache ends at once with an error."""
        if req.peak_tokens > self.limits.kv_slots:
            return TokenDelta(request_id=req.id, token_ids=[], finish_reason="error")
        self.waiting.append(req)
        self.by_id[req.id] = req
        return None

    def abort(self, request_id: str) -> Optional[TokenDelta]:
        """Drop a request and free its KV at once (after the step in flight, if it is in it)."""
        req = self.by_id.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            return self._finish(req, "abort")
        if self._in_flight is not None:
            self._deferred_aborts.append(request_id)
            return None
        return self._finish(req, "abort")

    # ---- one step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Optional[StepPlan]:
        """The next step's plan, or None when nothing can run."""
        assert self._in_flight is None, "schedule() called while a step is in flight"
        lim = self.limits
        budget = lim.batch_max_tokens
        plan = StepPlan(step=self._step, release_rows=self._release_rows)
        self._release_rows = []
        in_flight: list[tuple[int, bool]] = []

        decoding = [r for r in self.running.values() if not r.prefilling]
        for req in decoding:
            slot = self.kv.alloc(1)[0]
            req.slots.append(slot)
            req.num_computed += 1
            plan.decode_rows.append(req.row)
            plan.decode_slots.append(slot)
            in_flight.append((req.row, True))
        budget -= len(decoding)

        for req in list(self.running.values()):
            if req.prefilling and budget > 0:
                budget -= self._add_chunk(plan, req, budget, in_flight)

        if decoding:
            self._steps_since_admit += 1
        if self._may_admit(bool(decoding)):
            admitted = False
            while self.waiting and budget > 0 and self._free_rows:
                req = self.waiting[0]
                if not lim.chunked_prefill and req.prompt_len > budget:
                    break
                if not self._kv_fits(req):
                    break
                self.waiting.popleft()
                req.status = Status.RUNNING
                req.row = self._free_rows.pop()
                self.running[req.row] = req
                plan.new.append(NewSeq(row=req.row, request_id=req.id, sampling=req.sampling,
                                       prompt_ids=req.prompt_ids))
                budget -= self._add_chunk(plan, req, budget, in_flight)
                admitted = True
            if admitted:
                self._steps_since_admit = 0

        if not in_flight:  # nothing to compute: releases ride along with the next real step
            self._release_rows = plan.release_rows + self._release_rows
            return None
        self._in_flight = in_flight
        self._step += 1
        return plan

    def _add_chunk(self, plan: StepPlan, req: Request, budget: int, in_flight: list) -> int:
        lim = self.limits
        n = req.prompt_len - req.num_computed
        if lim.chunked_prefill:
            n = min(n, budget, lim.chunked_prefill_size)
        start = req.num_computed
        slots = self.kv.alloc(n)
        req.slots.extend(slots)
        req.num_computed += n
        last = not req.prefilling
        plan.prefill.append(PrefillChunk(row=req.row, token_ids=req.prompt_ids[start : start + n], start=start,
                                         slots=slots, sample=last))
        in_flight.append((req.row, last))
        return n

    def _may_admit(self, decoding: bool) -> bool:
        if not decoding or self._steps_since_admit >= self.limits.max_wait_tokens:
            return True
        return self.kv.num_used < self.limits.token_ratio * self.kv.num_slots

    def _kv_fits(self, candidate: Request) -> bool:
        reqs = list(self.running.values()) + [candidate]
        # cached now (or once prefilled): every token but the last sampled one, which the next step feeds
        held = np.fromiter((r.num_tokens - 1 for r in reqs), dtype=np.int64, count=len(reqs))
        left = np.fromiter((r.max_new_tokens - len(r.output_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        order = np.argsort(-left, kind="stable")
        need = (np.cumsum(held[order]) + left[order] * np.arange(1, len(reqs) + 1)).max()
        return int(need) <= self.limits.kv_slots

    # ---- results back ----------------------------------------------------------------------

    def on_result(self, result: StepResult) -> list[TokenDelta]:
        """Append sampled tokens, finish requests that hit a stop condition; one delta per request."""
        assert self._in_flight is not None, "a result arrived with no step in flight"
        self._in_flight = None
        deltas: list[TokenDelta] = []
        has_lp = bool(result.logprobs)
        for i, (row, token) in enumerate(zip(result.rows, result.token_ids)):
            req = self.running.get(row)
            if req is None:
                continue
            req.output_ids.append(token)
            delta = TokenDelta(request_id=req.id, token_ids=[token])
            if has_lp:
                delta.logprobs = [result.logprobs[i]]
                if result.top_ids and result.top_ids[i]:
                    delta.top_ids = [result.top_ids[i]]
                    delta.top_logprobs = [result.top_logprobs[i]]
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
                delta.finish_reason = reason
            deltas.append(delta)
        for request_id in self._deferred_aborts:
            d = self.abort(request_id)
            if d is not None:
                deltas.append(d)
        self._deferred_aborts = []
        return deltas

    def _stop_reason(self, req: Request, token: int) -> Optional[str]:
        sp = req.sampling
        if (not sp.ignore_eos and token in self.limits.eos_ids) or token in sp.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= sp.max_new_tokens or req.num_tokens >= self.limits.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> TokenDelta:
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.row is not None:
            self.running.pop(req.row, None)
            self._free_rows.append(req.row)
            self._release_rows.append(req.row)
            req.row = None
        self.kv.free(req.slots)
        req.slots = []
        self.by_id.pop(req.id, None)
        return TokenDelta(request_id=req.id, token_ids=[], finish_reason=reason)
