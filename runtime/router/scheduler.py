"""Continuous batching: each step runs every decoding request, continues chunked prefills and admits
waiting requests while the token budget, the row limit and the KV budget allow: lower `priority`
first (vLLM's), first come first served within a priority.

Steps may be pipelined: with `pipeline_depth` 2 the router plans step N+1 before step N's tokens are
back (the worker feeds each row its own last sampled token), so the GPU never waits for the host.
A request that turns out to have finished at step N wastes its slot in step N+1; its KV and row are
freed once no step in flight refers to it.

Admission never over-commits KV: a request is admitted only if the peak KV of all running requests
plus it, each run to its max_new_tokens, fits (LightLLM's estimate: sort by tokens left to allocate;
when the i-th longest finishes, the i+1 longest each hold their current tokens plus that many more;
the peak is the largest of these sums; a prompt still prefilling after this step counts at its
peak instead, since it starts growing late). Allocation therefore cannot fail. Pure logic: no sockets,
no tensors.

With the prompt cache (`prompt_cache`), an admitted request reuses the KV of the longest cached
prefix of its prompt (all but its last token, which must be computed to sample) and locks it; its
finished sequence joins the tree once no step in flight uses it, so KV of a step still out is never
matched. Admission counts the tree's unlocked tokens as free (they are evicted when allocation needs
room) and its locked ones once, however many requests share them.

Prefill/decode disaggregation (`pd_role`): the KV transfers' bookkeeping is runtime/router/pd_transfers.py's
(`self.pd`), what their ends do to requests is here.
"""
from __future__ import annotations

import time

from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.models.memory import PROMPT_LOGPROB_TOKENS
from llaunch.runtime.ipc.messages import (KvDone, NewSeq, PrefillChunk, StepPlan,
                                          StepResult, TokenDelta)
from llaunch.runtime.router.pd_transfers import KvTransfers
from llaunch.runtime.router.tiered_cache import prompt_cache_for
from llaunch.runtime.router.prompt_sharing import PromptSharing
from llaunch.runtime.router.request import Request, Status
from llaunch.runtime.router.spec_decode import SpecDecoding


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
    pipeline_depth: int = 1  # steps planned ahead of their results
    prompt_cache: bool = False  # share prompt prefixes through the radix tree
    pd_role: Optional[str] = None  # "prefill" | "decode" on a pd instance
    max_waiting: int = 2**31  # requests waiting for admission; a new one beyond it is refused (overloaded)
    diverse_mode: bool = False  # requests of one prompt prefill it once (router.diverse_mode; needs prompt_cache)
    # prompt positions whose logprobs one step computes: each is a vocabulary-wide float32 row, so
    # requests that ask prefill in chunks of at most this many (the memory plan counts them)
    prompt_logprob_tokens: int = PROMPT_LOGPROB_TOKENS
    spec: Optional[object] = None  # runtime.config.SpecConfig: speculative decoding (None: off)
    vocab_size: int = 2**62  # ids at or past it are images' tokens (vocab + hash): never proposed
    host_kv_tokens: int = 0  # slots of the host KV tier below the prompt cache (cache.cpu_tokens; 0: none)
    dp_fetch: tuple = ()  # cache.dp_fetch: (own dp rank, every replica's host index file); (): off
    pools_prompt: bool = False  # an embedding model's mean / CLS pooling: requests read every prompt position


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.kv = KvAllocator(limits.kv_slots)
        self.cache = prompt_cache_for(self.kv, limits.prompt_cache, limits.host_kv_tokens, limits.dp_fetch)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # row → request, finished ones until their steps return
        self.by_id: dict[str, Request] = {}
        self._free_rows = list(range(limits.max_running - 1, -1, -1))
        self._release_rows: list[int] = []
        self._step = 0
        self._logprob_room = limits.prompt_logprob_tokens  # this step's, reset by schedule()
        self._steps_since_admit = 0
        self._in_flight: deque[list[Request]] = deque()  # per step out: its requests, in sample order
        self._in_flight_all: deque[list[Request]] = deque()  # per step out: every request it touches
        self.pd = KvTransfers(self.cache)  # prefill/decode disaggregation's KV moves
        self.spec = SpecDecoding(limits.spec, limits.vocab_size, limits.max_model_len)
        self.sharing = PromptSharing(limits.diverse_mode and limits.prompt_cache and limits.pd_role is None, self.cache)

    # ---- requests in -----------------------------------------------------------------------

    def add(self, req: Request) -> Optional[TokenDelta]:
        """Queue a request; one that could never fit the KV cache ends at once with an error, and one
        beyond the wait queue's bound is refused (the frontend answers 503 with Retry-After)."""
        # the pipeline margin of `_kv_fits`: a request alone must fit it, or it would wait for good
        if req.peak_tokens + self.limits.pipeline_depth - 1 > self.limits.kv_slots:
            return TokenDelta(request_id=req.id, token_ids=[], finish_reason="error",
                              error=f"it needs {req.peak_tokens} KV slots; the cache holds {self.limits.kv_slots}")
        if len(self.waiting) + len(self.pd.awaiting) >= self.limits.max_waiting:
            return self.overloaded(req.id)
        if req.pd is not None and self.limits.pd_role == "decode":
            self.pd.awaiting.append(req)
        else:
            self._enqueue(req)
        self.by_id[req.id] = req
        return None

    def _enqueue(self, req: Request) -> None:
        """Into the wait queue behind every request of its priority or a lower (more urgent) one."""
        at = len(self.waiting)
        while at and self.waiting[at - 1].priority > req.priority:
            at -= 1
        self.waiting.insert(at, req)

    def overloaded(self, request_id: str) -> TokenDelta:
        return TokenDelta(request_id=request_id, token_ids=[], finish_reason="overloaded",
                          error=f"{self.limits.max_waiting} requests are already waiting "
                                "(router.max_waiting_requests); retry later")

    def abort(self, request_id: str) -> Optional[TokenDelta]:
        """End a request now; its KV is freed (or cached) at once, or when the steps in flight that use
        it return."""
        req = self.by_id.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        if req.status is Status.WAITING:
            (self.pd.awaiting if req in self.pd.awaiting else self.waiting).remove(req)
        if req.status is Status.TRANSFER:
            # its slots are the worker's until KvDone: end it now, free them then
            if req.row is None:
                self.pd.cancel(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"
            self.by_id.pop(req.id, None)
            return TokenDelta(request_id=req.id, token_ids=[], finish_reason="abort")
        return self._finish(req, "abort")

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.running.values() if r.status is Status.RUNNING)

    def has_work(self) -> bool:
        return bool(self.waiting or self.num_running)

    @property
    def steps_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def kv_in_use(self) -> int:
        """Slots requests need now: allocated ones less the cache entries that can be evicted."""
        return self.kv.num_used - self.cache.evictable

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> Optional[StepPlan]:
        """The next step's plan, or None when nothing can run."""
        lim = self.limits
        budget = lim.batch_max_tokens
        plan = StepPlan(step=self._step, release_rows=self._release_rows)
        self._release_rows = []
        samplers: list[Request] = []
        touched: list[Request] = []
        self._logprob_room = lim.prompt_logprob_tokens

        decoding = [r for r in self.running.values() if r.status is Status.RUNNING and self._decodes(r)]
        decoding, proposals = self.spec.split(self, decoding)
        for req in decoding:
            slot = self.cache.alloc(1)[0]
            req.slots.append(slot)
            req.num_computed += 1
            req.num_planned += 1
            plan.decode_rows.append(req.row)
            plan.decode_slots.append(slot)
        samplers += decoding
        touched += decoding
        budget -= len(decoding)
        verifying = self.spec.plan(self, plan, proposals)
        touched += verifying
        budget -= sum(len(v.token_ids) for v in plan.verify)

        for req in list(self.running.values()):
            if req.status is Status.RUNNING and req.prefilling and budget > 0 and self._chunk_room(req):
                budget -= self._add_chunk(plan, req, budget, samplers, touched)

        if decoding or verifying:
            self._steps_since_admit += 1
        if self._may_admit(bool(decoding or verifying)):
            admitted = False
            held = 0  # waiting requests at the front that diverse mode holds: the others go past them
            while len(self.waiting) > held and budget > 0 and self._free_rows:
                req = self.waiting[held]
                if self.sharing.waits(req):  # its prompt is being computed: it borrows the KV once that is done
                    held += 1
                    continue
                if not self._chunk_room(req):
                    break
                if not req.kv_ready:  # received KV has its slots (and its cached prefix locked) already
                    self.cache.lend(req)
                if ((not lim.chunked_prefill and req.prompt_len - req.num_computed > budget)
                        or not self._kv_fits(req, budget)):
                    if not req.kv_ready:
                        self.cache.take_back(req)
                    break
                del self.waiting[held]
                req.status = Status.RUNNING
                req.scheduled_time = time.time()
                req.row = self._free_rows.pop()
                self.running[req.row] = req
                plan.new.append(NewSeq(row=req.row, request_id=req.id, sampling=req.sampling,
                                       prompt_ids=req.prompt_ids, cached_slots=req.slots[:req.num_computed],
                                       images=req.images))
                budget -= self._add_chunk(plan, req, budget, samplers, touched)
                self.cache.admitted(req)
                self.sharing.admitted(req)
                admitted = True
            if admitted:
                self._steps_since_admit = 0

        if not touched:  # nothing to compute: releases ride along with the next real step
            self._release_rows = plan.release_rows + self._release_rows
            return None
        plan.kv_moves = self.cache.take_moves()  # before the forward, which may reuse slots they free
        for req in touched:
            req.steps_in_flight += 1
        self._in_flight.append(samplers)
        self._in_flight_all.append(touched)
        self._step += 1
        return plan

    def _decodes(self, req: Request) -> bool:
        """Decode once more unless the prompt is still prefilling or the tokens already planned
        reach a length limit (so pipelining never plans a step past max_tokens)."""
        if req.prefilling:
            return False
        return (req.num_planned < req.max_new_tokens
                and req.prompt_len + req.num_planned < self.limits.max_model_len)

    def _add_chunk(self, plan: StepPlan, req: Request, budget: int, samplers: list, touched: list) -> int:
        lim = self.limits
        n = req.prompt_len - req.num_computed
        if lim.chunked_prefill:
            n = min(n, budget, lim.chunked_prefill_size)
        if req.sampling.prompt_logprobs >= 0:  # chunked whatever router.chunked_prefill says
            n = min(n, self._logprob_room)
            self._logprob_room -= n
        start = req.num_computed
        slots = self.cache.alloc(n)
        req.slots.extend(slots)
        req.num_computed += n
        last = not req.prefilling
        plan.prefill.append(PrefillChunk(row=req.row, token_ids=req.prompt_ids[start : start + n], start=start,
                                         slots=slots, sample=last))
        touched.append(req)
        if last:
            req.num_planned += 1
            samplers.append(req)
        return n

    def _chunk_room(self, req: Request) -> bool:
        """Whether a chunk of `req` fits this step's prompt-logprob positions (others always do)."""
        return req.sampling.prompt_logprobs < 0 or self._logprob_room > 0

    # ---- prefill/decode disaggregation's KV transfers (runtime/router/pd_transfers.py) --------------

    def admit_transfers(self) -> None:
        """Decode instance: slots to receive into for the transfers waiting, while the KV budget allows."""
        self.pd.admit(self._kv_fits)

    def on_kv_done(self, msg: KvDone) -> list[TokenDelta]:
        """A transfer ended: a sent prompt finishes (kv_sent, or error); received KV makes its request
        ready to run from its last prompt token, ahead of the wait queue."""
        req = self.pd.ended(msg.request_id)
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

    def _holding(self, candidate: Optional[Request]) -> list[Request]:
        """Requests holding KV without running: transfers, and received KV waiting for a row."""
        return [r for r in self.pd.held() if r is not candidate] + \
            [r for r in self.waiting if r.kv_ready and r is not candidate]

    def _may_admit(self, decoding: bool) -> bool:
        if not decoding or self._steps_since_admit >= self.limits.max_wait_tokens:
            return True
        return self.kv_in_use < self.limits.token_ratio * self.kv.num_slots

    def _kv_fits(self, candidate: Request, budget: int) -> bool:
        """The candidate's cached prefix must be locked already: locked tree tokens count once.
        `budget`: tokens left in this step for the candidate's first chunk."""
        lim = self.limits
        live = [r for r in self.running.values() if r.status in (Status.RUNNING, Status.TRANSFER)]
        live += self._holding(candidate)
        # finished requests whose steps are still out hold their slots a little longer
        lingering = sum(len(r.slots) - r.num_cached for r in self.running.values() if r.status is Status.FINISHED)
        lingering += self.spec.void_slots  # void chained verifies' slots, freed when their step returns
        shared = self.cache.locked
        margin = lim.pipeline_depth - 1  # a finished request frees its KV this many steps late
        n = len(live) + 1
        held = np.empty(n, dtype=np.int64)
        left = np.empty(n, dtype=np.int64)
        # Counted after this step's allocations; a prompt counts whole from its first chunk on, since
        # chunks grow faster than the one slot per step the estimate assumes. Own slots only: the
        # cached prefix is in `shared`.
        for i, r in enumerate(live + [candidate]):
            held[i] = max(r.num_computed, r.prompt_len) - r.num_cached
            left[i] = r.peak_tokens - r.num_cached - held[i] + margin  # slots it may still take
        # A prompt still prefilling after this step starts growing late, so the requests that finish
        # meanwhile do not make room for it: it counts at its peak throughout.
        rest = candidate.prompt_len - candidate.num_computed
        late = np.array([r.prefilling for r in live]
                        + [lim.chunked_prefill and rest > min(budget, lim.chunked_prefill_size)], dtype=bool)
        fixed = int((held[late] + left[late]).sum())
        held, left = held[~late], left[~late]
        order = np.argsort(-left, kind="stable")
        growing = (np.cumsum(held[order]) + left[order] * np.arange(1, len(order) + 1)).max(initial=0)
        return int(growing) + fixed + lingering + shared <= lim.kv_slots

    # ---- results back ----------------------------------------------------------------------

    def on_result(self, result: StepResult) -> list[TokenDelta]:
        """Tokens of the oldest step in flight: append them, finish requests that hit a stop
        condition, free what no step in flight uses any more. One delta per live request."""
        samplers = self._in_flight.popleft()
        touched = self._in_flight_all.popleft()
        self.cache.returned()
        if result.scores:  # a score model: the prompt's head outputs end each request; no token is generated
            deltas = [self._scored(req, sc) for req, sc in zip(samplers, result.scores) if req.status is Status.RUNNING]
            self._returned(touched)
            return deltas
        if len(result.token_ids) != len(samplers):
            raise RuntimeError(f"step {result.step}: {len(result.token_ids)} tokens for {len(samplers)} samplers")
        deltas: list[TokenDelta] = []
        has_lp = bool(result.logprobs)
        for i, (req, token) in enumerate(zip(samplers, result.token_ids)):
            if req.status is not Status.RUNNING:
                continue  # finished while this step was out: the token is dropped
            req.output_ids.append(token)
            delta = TokenDelta(request_id=req.id, token_ids=[token])
            if len(req.output_ids) == 1:
                delta.cached_tokens, delta.scheduled_time = req.num_cached, req.scheduled_time
                self.sharing.computed(req)
            if has_lp:
                delta.logprobs = [result.logprobs[i]]
                if result.top_ids and result.top_ids[i]:
                    delta.top_ids = [result.top_ids[i]]
                    delta.top_logprobs = [result.top_logprobs[i]]
            if result.prompt_logprobs and result.prompt_logprobs[i] is not None:
                delta.prompt_logprobs = result.prompt_logprobs[i]
            reason = self._stop_reason(req, token)
            if reason is not None and req.pd is not None and self.limits.pd_role == "prefill":
                self.pd.send(req)  # the decode instance samples the first token itself
                continue
            if reason is not None:
                self._finish(req, reason)
                delta.finish_reason = reason
            deltas.append(delta)
        deltas += self.spec.verified(self, result)
        self._returned(touched)
        return deltas

    def _returned(self, touched: list[Request]) -> None:  # a finished request no step uses is released
        for req in touched:
            req.steps_in_flight -= 1
            if req.status is Status.FINISHED and req.steps_in_flight == 0:
                self._release(req)

    def _scored(self, req: Request, scores: list[float]) -> TokenDelta:
        delta = self._finish(req, "stop")
        delta.scores, delta.cached_tokens, delta.scheduled_time = scores, req.num_cached, req.scheduled_time
        return delta

    def _stop_reason(self, req: Request, token: int) -> Optional[str]:
        sp = req.sampling
        if (not sp.ignore_eos and token in self.limits.eos_ids) or token in sp.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= sp.max_new_tokens or req.num_tokens >= self.limits.max_model_len:
            return "length"
        return None

    def fail_all(self, reason: str, error: str) -> list[TokenDelta]:
        """End every request at once: the worker is gone, so no step in flight will come back and
        nothing is released (the replica serves nothing more)."""
        deltas = [TokenDelta(request_id=rid, token_ids=[], finish_reason=reason, error=error) for rid in self.by_id]
        self.by_id.clear()
        self.waiting.clear()
        self.running.clear()
        self.pd.clear()
        self.sharing.clear()
        self._in_flight.clear()
        self._in_flight_all.clear()
        self.cache.abandon()  # cache.dp_fetch: pins on other replicas' host pools go back
        return deltas

    def _finish(self, req: Request, reason: str) -> TokenDelta:
        self.sharing.ended(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.by_id.pop(req.id, None)
        if req.steps_in_flight == 0:
            self._release(req)
        return TokenDelta(request_id=req.id, token_ids=[], finish_reason=reason)

    def _release(self, req: Request) -> None:
        if req.row is not None:
            self.running.pop(req.row, None)
            self._free_rows.append(req.row)
            self._release_rows.append(req.row)
            req.row = None
        self.cache.release(req)
        req.slots = []
