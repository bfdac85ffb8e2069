"""Router process: sockets and the loop around the Scheduler.

requests (PULL, from frontends) ─┐
results  (PULL, from worker rank 0) ─┼─▶ Scheduler ─▶ plan.{r} (PUSH, every tp rank)
                                     └─▶ tokens (PUSH, to the detokenizer)
"""
from __future__ import annotations

import logging
import os
import random
import time
from collections import deque

import msgspec
import zmq

from llaunch.runtime import bootstrap
from llaunch.runtime.config import Mode, ModelTask, OnStall, Pooling, RunConfig
from llaunch.runtime.ipc.messages import (AbortRequest, AddRequest, ConstraintsReady, FlushCache, KvDone, Profile,
                                          PrepareConstraints, RequestOpened, RouterInbound, RouterResults,
                                          RouterStats, Shutdown, StepResult, TokenBatch, TokenDelta, WorkerReady,
                                          ImagesReady)
from llaunch.runtime.ipc.sockets import Receiver, Sender
from llaunch.runtime.router.admission import AdmissionLimits, refusal
from llaunch.runtime.router.grammar_gate import GrammarGate
from llaunch.runtime.router.image_gate import EndsSeen, ImageGate
from llaunch.runtime.router.health import EXIT_STALLED, EngineHealth, WorkerWatch
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.router.step_trace import StepTrace
from llaunch.runtime.router.tiered_cache import host_tier_stats

log = logging.getLogger("llaunch.router")
STATS_PERIOD_S = 0.25
PIPELINE_DEPTH = 2  # plan step N+1 while step N runs: the device never waits for the host
PD_ROLES = {Mode.pd_prefill: "prefill", Mode.pd_decode: "decode"}


def limits_from(cfg: RunConfig, ready: WorkerReady, spec=None) -> SchedulerLimits:
    r = cfg.router
    indexes = sorted(((int(k.split(".")[1]), v) for k, v in (spec.connects.items() if spec is not None else ())
                      if k.startswith("kv_index.")))  # cache.dp_fetch: every replica's host index, by rank
    return SchedulerLimits(
        kv_slots=ready.kv_slots,
        max_running=min(r.max_running_requests, ready.max_running_requests),
        batch_max_tokens=r.batch_max_tokens,
        chunked_prefill=r.chunked_prefill,
        chunked_prefill_size=r.chunked_prefill_size,
        max_wait_tokens=r.max_wait_tokens,
        token_ratio=r.token_ratio,
        max_model_len=cfg.model.max_model_len,
        eos_ids=tuple(cfg.model.eos_token_ids or ()),
        pipeline_depth=PIPELINE_DEPTH,
        prompt_cache=cfg.cache.prompt_cache,
        host_kv_tokens=cfg.cache.cpu_tokens,
        vocab_size=cfg.model.vocab_size,
        dp_fetch=(spec.dp_rank, tuple(path for _, path in indexes)) if indexes else (),
        pd_role=PD_ROLES.get(cfg.mode.kind),
        max_waiting=r.max_waiting_requests,
        diverse_mode=r.diverse_mode,
        spec=cfg.spec,
        pools_prompt=cfg.model.task == ModelTask.embed and cfg.model.pooling not in (None, Pooling.last),
    )


def admission_limits(cfg: RunConfig) -> AdmissionLimits:
    return AdmissionLimits(vocab_size=cfg.model.vocab_size, max_model_len=cfg.model.max_model_len,
                           max_stop_strings=cfg.server.max_stop_strings,
                           max_stop_string_chars=cfg.server.max_stop_string_chars)


class Router:
    def __init__(self, cfg: RunConfig, spec, ctx: zmq.Context):
        self.cfg = cfg
        self.spec = spec
        self.dp_rank = spec.dp_rank
        self.health = EngineHealth(cfg.router.stall_timeout_s)
        watch = WorkerWatch(ctx, self.health)
        self.requests = Receiver(ctx, spec.binds["requests"], RouterInbound)
        self.results = Receiver(ctx, spec.binds["results"], RouterResults, monitor=watch.monitor)
        watch.start()
        plan_keys = sorted((k for k in spec.connects if k.startswith("plan.")), key=lambda k: int(k.split(".")[1]))
        self.workers = [Sender(ctx, spec.connects[k]) for k in plan_keys]
        visual = sorted((k for k in spec.connects if k.startswith("visual.")), key=lambda k: int(k.split(".")[1]))
        self.visual = [Sender(ctx, spec.connects[k]) for k in visual]  # the visual servers (multimodal models)
        self.images = ImageGate(len(self.visual), self.dp_rank)  # requests whose images are being encoded
        self.detokenizer = EndsSeen(Sender(ctx, spec.connects["tokens"]), self.images,
                                    lambda: self._sent[-1][0] if self._sent else -1)
        self.scheduler: Scheduler | None = None
        self._rng = random.Random()
        self._last_stats = 0.0
        self._kv_reports: dict[str, list[KvDone]] = {}  # request id → the ranks' KvDone so far
        self.trace = StepTrace.for_replica(cfg.router.step_trace, self.dp_rank)
        self.admission = admission_limits(cfg)
        self._sent: deque[tuple[int, float]] = deque()  # steps out: (step, time sent)
        self.gate = GrammarGate(len(self.workers))  # requests whose grammar the workers still compile

    def wait_for_workers(self) -> None:
        """Until every tp rank has reported WorkerReady (loaded, warmed up): only then does this
        replica plan steps and report stats, which is what makes the frontends' /health/ready green."""
        ready: dict[int, WorkerReady] = {}
        while len(ready) < len(self.workers):
            msg = self.results.recv()
            if not isinstance(msg, WorkerReady):
                raise RuntimeError(f"expected WorkerReady first, got {type(msg).__name__}")
            ready[msg.tp_rank] = msg
        first = min(ready.values(), key=lambda m: m.kv_slots)  # the ranks agree; the smallest would bind
        self.scheduler = Scheduler(limits_from(self.cfg, first, self.spec))
        log.info("workers ready (%d rank(s)): %d KV slots, %d rows", len(ready), first.kv_slots,
                 self.scheduler.limits.max_running)

    def handle(self, msg) -> None:
        sched = self.scheduler
        if isinstance(msg, AddRequest):
            sampling = msg.sampling
            if sampling.seed is None:  # every request gets a seed so each rank samples identically
                sampling = msgspec.structs.replace(sampling, seed=self._rng.getrandbits(62))
            if msg.pd is not None and sched.limits.pd_role == "prefill":
                sampling = msgspec.structs.replace(sampling, max_new_tokens=1)  # the prompt's KV is the product
            self.detokenizer.send(RequestOpened(request_id=msg.request_id, frontend=msg.frontend,
                                                prompt_len=len(msg.prompt_ids), sampling=sampling,
                                                arrival_time=msg.arrival_time))
            reason = refusal(msg, self.admission)
            if reason is not None:
                log.warning("request %s refused: %s", msg.request_id, reason)
                rejected = TokenDelta(request_id=msg.request_id, token_ids=[], finish_reason="invalid", error=reason)
            elif self.health.stalled:
                rejected = TokenDelta(request_id=msg.request_id, token_ids=[], finish_reason="stalled",
                                      error=f"replica {self.dp_rank} is stalled: {self.health.gone or 'a step is overdue'}")
            elif (held := len(self.gate) + len(self.images)) and held + len(sched.waiting) >= sched.limits.max_waiting:
                rejected = sched.overloaded(msg.request_id)
            else:
                req = Request(msg, sampling, pools_prompt=sched.limits.pools_prompt)
                # a PD request's KV transfer is paced by the other instance: it is not held back here
                rejected = (None if msg.pd is None and (self.gate.hold(req) or self.images.hold(req))
                            else sched.add(req))
                self.prepare_constraints()
                self.send_images()
            if rejected is not None:
                if rejected.finish_reason == "error":
                    log.warning("request %s refused: %s", msg.request_id, rejected.error)
                self.detokenizer.send(TokenBatch(deltas=[rejected]))
        elif isinstance(msg, AbortRequest):
            held = self.gate.abort(msg.request_id) or self.images.abort(msg.request_id)
            delta = (TokenDelta(request_id=held.id, token_ids=[], finish_reason="abort") if held is not None
                     else sched.abort(msg.request_id))
            if delta is not None:
                self.detokenizer.send(TokenBatch(deltas=[delta]))
        elif isinstance(msg, FlushCache):
            log.info("prompt cache flushed: %d KV slots freed", sched.cache.flush())
            self.maybe_send_stats(force=True)
        elif isinstance(msg, Profile):  # on the plans' sockets: the workers take it between the steps sent so far
            for w in self.workers:
                w.send(msg)

    def prepare_constraints(self) -> None:
        if self.gate.to_prepare:
            for w in self.workers:  # every rank masks its own copy of the logits
                w.send(PrepareConstraints(constraints=self.gate.to_prepare))
            self.gate.to_prepare = []

    def on_constraints_ready(self, msg: ConstraintsReady) -> None:
        released, failed = self.gate.on_ready(msg)
        deltas = [d for d in (self.scheduler.add(r) for r in released if not self.images.hold(r)) if d is not None]
        self.send_images()
        deltas += [TokenDelta(request_id=r.id, token_ids=[], finish_reason="invalid",
                              error=f"the constraint does not compile: {error}") for r, error in failed]
        if deltas:
            self.detokenizer.send(TokenBatch(deltas=deltas))

    def on_images_ready(self, msg: ImagesReady) -> None:
        req, error = self.images.on_ready(msg)
        delta = (None if req is None else self.scheduler.add(req) if error is None
                 else TokenDelta(request_id=req.id, token_ids=[], finish_reason="invalid", error=error))
        if delta is not None:
            self.detokenizer.send(TokenBatch(deltas=[delta]))

    def send_images(self) -> None:
        """EncodeImages for newly held requests; ReleaseImages once no step in flight can read them."""
        self.images.returned(self._sent[0][0] - 1 if self._sent else 1 << 62)
        for v, msg in self.images.to_send:
            self.visual[v].send(msg)
        self.images.to_send = []

    def drain_inbound(self, block_ms: int) -> None:
        msg = self.requests.recv(timeout_ms=block_ms)
        while msg is not None:
            self.handle(msg)
            msg = self.requests.recv_nowait()

    def maybe_send_stats(self, force: bool = False) -> None:
        now = time.time()
        if force or now - self._last_stats >= STATS_PERIOD_S:
            s = self.scheduler
            held = len(self.gate) + len(self.images)
            self.detokenizer.send(RouterStats(time=now, running=s.num_running, waiting=len(s.waiting) + held,
                                              kv_used=s.kv.num_used, kv_total=s.kv.num_slots,
                                              dp_rank=self.dp_rank, kv_evictable=s.cache.evictable,
                                              prefix_cache_tokens=s.cache.tokens,
                                              prefix_cache_queries=s.cache.queries,
                                              prefix_cache_hits=s.cache.hits, stalled=self.health.stalled,
                                              **host_tier_stats(s.cache),
                                              stalls=self.health.stalls, spec_proposed=s.spec.proposed,
                                              spec_accepted=s.spec.accepted, spec_verify_rows=s.spec.verify_rows,
                                              spec_accepted_per_pos=list(s.spec.accepted_per_pos),
                                              spec_backoffs=s.spec.backoffs, spec_chained=s.spec.chained,
                                              spec_voided=s.spec.voided,
                                              mm_cache_queries=self.images.queries, mm_cache_hits=self.images.hits,
                                              images_encoded=self.images.encoded))
            self._last_stats = now

    def send_kv_commands(self) -> None:
        """Transfers the scheduler started or cancelled go to the worker (tp rank 0 holds the link)."""
        sched = self.scheduler
        if sched.pd.awaiting:
            sched.admit_transfers()
        for command in sched.pd.commands:
            for w in self.workers:  # each rank moves its own KV heads
                w.send(command)
        sched.pd.commands.clear()

    def on_kv_done(self, msg: KvDone) -> None:
        """One rank's transfer ended; the request's ends when every rank's has (failed if one did)."""
        if msg.error is not None:
            log.warning("KV transfer of %s failed: %s", msg.request_id, msg.error)
        reports = self._kv_reports.setdefault(msg.request_id, [])
        reports.append(msg)
        if len(reports) < len(self.workers):
            return
        del self._kv_reports[msg.request_id]
        errors = [r.error for r in reports if r.error is not None]
        msg = KvDone(request_id=msg.request_id, error=errors[0] if errors else None,
                     seconds=max(r.seconds for r in reports))
        deltas = self.scheduler.on_kv_done(msg)
        if deltas:
            self.detokenizer.send(TokenBatch(deltas=deltas))

    def poll_transfers(self, block_ms: int) -> None:
        """KvDone while no step is out (collect() handles those that come between steps)."""
        msg = self.results.recv(timeout_ms=block_ms)
        while msg is not None:
            if isinstance(msg, ConstraintsReady):
                self.on_constraints_ready(msg)
            elif isinstance(msg, KvDone):
                self.on_kv_done(msg)
            elif isinstance(msg, ImagesReady):
                self.on_images_ready(msg)
            else:
                raise RuntimeError(f"expected KvDone or ConstraintsReady from the worker, got {type(msg).__name__}")
            msg = self.results.recv_nowait()

    def fill_pipeline(self) -> None:
        """Plan ahead up to the pipeline depth, so the worker always has its next step queued."""
        while self.scheduler.steps_in_flight < self.scheduler.limits.pipeline_depth:
            plan = self.scheduler.schedule()
            if plan is None:
                return
            for w in self.workers:
                w.send(plan)
            self._sent.append((plan.step, time.monotonic()))
            if self.trace.enabled:
                arrivals = tuple(self.scheduler.running[n.row].arrival_time for n in plan.new)
                self.trace.planned(plan, self.scheduler.num_running, len(self.scheduler.waiting), arrivals)

    def collect(self) -> None:
        """Wait for the oldest step's tokens, handling requests that arrive meanwhile and watching for
        a stall; a gone worker abandons the wait (its replica then serves nothing)."""
        while True:
            result = self.results.recv(timeout_ms=20)
            if isinstance(result, KvDone):
                self.on_kv_done(result)
                continue
            if isinstance(result, ConstraintsReady):
                self.on_constraints_ready(result)
                continue
            if isinstance(result, ImagesReady):
                self.on_images_ready(result)
                continue
            if result is not None:
                break
            self.drain_inbound(block_ms=0)
            step, sent = self._sent[0]
            if self.watch_health(step, time.monotonic() - sent):
                return
            self.maybe_send_stats()
        if not isinstance(result, StepResult):
            raise RuntimeError(f"expected a StepResult from the worker, got {type(result).__name__}")
        self._sent.popleft()
        self.health.step_returned()
        self.trace.returned(result)
        deltas = self.scheduler.on_result(result)
        if deltas:
            self.detokenizer.send(TokenBatch(deltas=deltas))
        self.send_images()

    def watch_health(self, step: int = -1, waited_s: float = 0.0) -> bool:
        """Check for a stall or a gone worker and act on it (router.on_stall); True once a worker is
        gone: nothing in flight will come back."""
        if self.health.check_step(step, waited_s) or self.health.check_workers():
            if self.cfg.router.on_stall == OnStall.exit:
                log.error("router.on_stall=exit: stopping, so the graph goes down (exit %d)", EXIT_STALLED)
                logging.shutdown()
                os._exit(EXIT_STALLED)
            if self.health.gone is not None:
                deltas = self.scheduler.fail_all("stalled", f"replica {self.dp_rank}: {self.health.gone}")
                deltas += [TokenDelta(request_id=r.id, token_ids=[], finish_reason="stalled",
                                      error=f"replica {self.dp_rank}: {self.health.gone}") for r in self.gate.take_all() + self.images.take_all()]
                self._sent.clear()
                if deltas:
                    self.detokenizer.send(TokenBatch(deltas=deltas))
            self.maybe_send_stats(force=True)
        return self.health.gone is not None

    def run(self) -> None:
        sched = self.scheduler
        while True:
            if self.watch_health():  # a worker is gone: refuse what comes, report, plan nothing
                self.drain_inbound(block_ms=int(STATS_PERIOD_S * 1000))
                self.maybe_send_stats()
                continue
            idle = not sched.has_work() and not sched.steps_in_flight
            waits = sched.pd.moving or len(self.gate) or len(self.images)  # for worker reports that no step result brings
            self.drain_inbound(block_ms=int(STATS_PERIOD_S * 1000) if idle and not waits else 0)
            self.send_images()
            self.send_kv_commands()
            if waits and not sched.steps_in_flight:
                self.poll_transfers(block_ms=2 if idle else 0)
                self.send_kv_commands()
            self.fill_pipeline()
            if self.scheduler.steps_in_flight:
                self.collect()
            self.maybe_send_stats(force=not idle and not self.scheduler.has_work())

    def shutdown(self) -> None:
        for w in self.workers:
            w.send(Shutdown())


def main() -> None:
    cfg, spec = bootstrap.start()
    ctx = zmq.Context()
    router = Router(cfg, spec, ctx)
    router.wait_for_workers()
    bootstrap.report_ready(ctx, cfg, spec, kv_slots=router.scheduler.kv.num_slots)
    router.run()


if __name__ == "__main__":
    main()
