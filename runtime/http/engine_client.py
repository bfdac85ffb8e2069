"""The frontend's side of the engine: submit requests to a router replica, route the text that comes
back to the HTTP request waiting for it, abort what nobody waits for any more.

`EngineClient` is the logic and talks through a `post(replica, message)` coroutine; `ZmqEngineLink`
is the ZMQ transport (PUSH to every router replica, PULL from the detokenizer). Tests drive the
client with a scripted router in place of the link.

Data parallelism: each HTTP request goes to the replica with the least load, measured as the tokens
this frontend has outstanding there (prompt + max_new_tokens of every unfinished request: the peak
KV the router's admission reserves for it), ties to the fewest requests, then the lowest index. MetricsSnapshot carries only totals over replicas, so
the frontend balances on what it knows itself (with several HTTP workers, each balances its own).
With `prefill_balance` (router.dp_prefill_balance), the first criterion is the prompt tokens each
replica still has to prefill (a request's until its first token comes back), so long prompts spread
over the replicas instead of queueing behind each other where the load happens to be lowest.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import time
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence

import zmq.asyncio

from llaunch.runtime.config import ProcessSpec
from llaunch.runtime.web.errors import engine_failed
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.http.prefix_affinity import PrefixAffinity
from llaunch.runtime.ipc.messages import (AbortRequest, AddRequest, Constraint, FlushCache, FrontendInbound, Profile,
                                          MetricsSnapshot, PdLink, RouterInbound, SamplingParams, TextBatch, TextDelta)
from llaunch.runtime.ipc.sockets import AsyncReceiver, AsyncSender

log = logging.getLogger(__name__)

Post = Callable[[int, RouterInbound], Awaitable[None]]
# A pd instance's route sets the pd_master's link of the HTTP request it handles (runtime/http/pd_instance.py)
current_pd_link: contextvars.ContextVar[Optional[PdLink]] = contextvars.ContextVar("pd_link", default=None)


REFUSALS = ("invalid", "overloaded")  # the router's answers to a request it did not take


class RequestGroup:
    """The engine requests behind one HTTP request (n samples, several prompts): their text arrives
    on one queue as (choice index, delta) until every one of them has finished, or the request's
    deadline (server.request_timeout_s) passes."""

    def __init__(self, client: "EngineClient", request_ids: list[str], replica: int,
                 lifecycle: Optional[Lifecycle] = None, timeout_s: Optional[float] = None):
        self.request_ids = request_ids
        self.replica = replica
        self._client = client
        self._queue: asyncio.Queue[tuple[int, TextDelta]] = asyncio.Queue()
        self._open = set(range(len(request_ids)))
        self._lifecycle = lifecycle  # counts the HTTP request in flight until `close`
        self._closed = False
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._peeked: Optional[tuple[int, TextDelta]] = None

    @property
    def finished(self) -> bool:
        return not self._open

    def _deliver(self, choice: int, delta: TextDelta) -> None:
        self._queue.put_nowait((choice, delta))

    async def _next(self) -> tuple[int, TextDelta]:
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
        if self._deadline is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), max(0.0, self._deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise engine_failed("timeout", f"The request did not finish within {self._timeout_s:g} s "
                                           "(server.request_timeout_s).") from None

    async def admitted(self) -> None:
        """Wait for the first delta and raise the router's refusal (invalid request, overloaded) as an
        ApiError: a stream can then still answer with its status, not a 200 and an error event."""
        self._peeked = item = await self._next()
        if item[1].finish_reason in REFUSALS:
            raise engine_failed(item[1].finish_reason, item[1].error)

    async def __aiter__(self) -> AsyncIterator[tuple[int, TextDelta]]:
        while self._open:
            choice, delta = await self._next()
            if delta.finish_reason is not None:
                self._open.discard(choice)
            yield choice, delta

    async def close(self) -> None:
        """The HTTP request is done with the group (answered, failed, or its client left): abort what
        still runs, then end its count in the lifecycle, so a drain can finish. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.finished:
                await self.abort()
        finally:
            if self._lifecycle is not None:
                self._lifecycle.end()

    async def abort(self) -> None:
        """Stop every request still running (client gone, or the server gave up on it)."""
        open_ids = [self.request_ids[c] for c in sorted(self._open)]
        self._open.clear()
        await self._client._abort(open_ids, self.replica)


async def admitted(group: RequestGroup) -> None:
    """group.admitted(); on a refusal (or any failure) the group is closed before the error goes up."""
    try:
        await group.admitted()
    except BaseException:
        await group.close()
        raise


class _Route:
    __slots__ = ("group", "choice", "tokens", "prefill")

    def __init__(self, group: RequestGroup, choice: int, tokens: int, prefill: int):
        self.group = group
        self.choice = choice
        self.tokens = tokens  # what the request adds to its replica's load until it finishes
        self.prefill = prefill  # prompt tokens its replica still has to prefill (0 from its first token)


class EngineClient:
    def __init__(self, frontend_index: int, num_replicas: int, post: Post, request_timeout_s: Optional[float] = None,
                 prefill_balance: bool = False, affinity_slack: Optional[int] = None):
        """`affinity_slack` (router.dp_prefix_affinity): a prompt goes to the replica that got its longest
        known prefix unless its load exceeds the least loaded replica's by more than these tokens."""
        self.frontend_index = frontend_index
        self.affinity = PrefixAffinity() if affinity_slack is not None and num_replicas > 1 else None
        self.affinity_slack = affinity_slack or 0
        self.request_timeout_s = request_timeout_s
        self.prefill_balance = prefill_balance
        self.outstanding = [0] * num_replicas  # requests of this frontend each replica still runs
        self.outstanding_tokens = [0] * num_replicas  # their prompt + max_new_tokens: the load
        self.pending_prefill = [0] * num_replicas  # prompt tokens not yet prefilled there
        self._post = post
        self._counter = itertools.count()
        self._routes: dict[str, _Route] = {}
        self._last_heartbeat: Optional[float] = None
        self.metrics: Optional[MetricsSnapshot] = None
        # awaited with a request's constraints before it is sent: they must compile (set by the app:
        # runtime/http/constraint_compiles.py); it raises the ApiError that refuses the request
        self.constraint_gate: Optional[Callable[[list[Constraint]], Awaitable[None]]] = None

    @property
    def running(self) -> int:
        return len(self._routes)

    def heartbeat_age(self) -> float:
        """Seconds since the last MetricsSnapshot (the engine's heartbeat); inf before the first."""
        return math.inf if self._last_heartbeat is None else time.monotonic() - self._last_heartbeat

    async def submit(self, jobs: list[tuple[list[int], SamplingParams]], pd: Optional[PdLink] = None,
                     lifecycle: Optional[Lifecycle] = None, images: Optional[list] = None, priority: int = 0,
                     replica: Optional[int] = None, prediction_ids: Sequence[int] = ()) -> RequestGroup:
        """`pd` (default: `current_pd_link`): the pd_master's transfer link of this HTTP request on a pd
        instance; choice c's engine request gets `<id>.<c>`. With a `lifecycle`, the HTTP request
        counts as in flight from here until the group's `close`. A failure part-way (a message that
        cannot be sent) leaves nothing behind: the group's routes and counts are undone and what was
        sent is aborted. `priority`: vLLM's (lower first); `replica`: LightLLM's suggested_dp_index
        (one out of range is ignored, as LightLLM does); `prediction_ids`: a chat request's predicted output
        (runtime/http/predicted_output.py), for every choice."""
        pd = pd if pd is not None else current_pd_link.get()
        constraints = [s.constraint for _, s in jobs if s.constraint is not None]
        if constraints and self.constraint_gate is not None:
            await self.constraint_gate(constraints)
        if lifecycle is not None:
            lifecycle.begin()
        # One replica for the whole group: the n samples of a prompt share its prefix cache there.
        if replica is None or not 0 <= replica < len(self.outstanding):
            replica = self.choose_replica(jobs[0][0])
        ids = [f"{self.frontend_index}-{next(self._counter)}" for _ in jobs]
        group = RequestGroup(self, ids, replica, lifecycle, self.request_timeout_s)
        sent: list[str] = []
        try:
            now = time.time()
            for choice, (request_id, (prompt_ids, sampling)) in enumerate(zip(ids, jobs)):
                link = None if pd is None else PdLink(id=f"{pd.id}.{choice}", decode_kv=pd.decode_kv)
                msg = AddRequest(request_id=request_id, frontend=self.frontend_index, prompt_ids=prompt_ids,
                                 sampling=sampling, arrival_time=now, pd=link, images=images or [], priority=priority,
                                 prediction_ids=list(prediction_ids))
                # registered before it is sent: its answer may come back before post returns
                tokens = len(prompt_ids) + sampling.max_new_tokens
                self._routes[request_id] = _Route(group, choice, tokens, len(prompt_ids))
                self.outstanding[replica] += 1
                self.outstanding_tokens[replica] += tokens
                self.pending_prefill[replica] += len(prompt_ids)
                await self._post(replica, msg)
                sent.append(request_id)
        except BaseException:
            for request_id in ids:
                self._forget(request_id, replica)
            for request_id in sent:
                try:
                    await self._post(replica, AbortRequest(request_id=request_id))
                except Exception:  # the router is gone: nothing runs there to abort
                    log.exception("could not abort %s after a failed submit", request_id)
            if lifecycle is not None:
                lifecycle.end()
            raise
        return group

    @property
    def stalled_replicas(self) -> list[int]:
        return self.metrics.stalled_replicas if self.metrics is not None else []

    @property
    def loading_replicas(self) -> list[int]:
        """Replicas whose workers have not all loaded and warmed up yet (every one before the first heartbeat)."""
        return self.metrics.loading_replicas if self.metrics is not None else list(range(len(self.outstanding)))

    def choose_replica(self, prompt_ids: list[int]) -> int:
        """The least loaded replica, or with prefix affinity the one holding the prompt's longest known
        prefix while its load stays within the slack of the least loaded one's."""
        best = self.least_loaded()
        if self.affinity is None:
            return best
        held = self.affinity.holder(prompt_ids)
        if (held is not None and held[0] not in self.stalled_replicas
                and self.outstanding_tokens[held[0]] <= self.outstanding_tokens[best] + self.affinity_slack):
            best = held[0]
        self.affinity.record(prompt_ids, best)
        return best

    def least_loaded(self) -> int:
        """The replica with the least outstanding load, among those not stalled (if any is not)."""
        stalled = set(self.stalled_replicas)
        healthy = [d for d in range(len(self.outstanding)) if d not in stalled] or range(len(self.outstanding))
        if self.prefill_balance:
            return min(healthy, key=lambda d: (self.pending_prefill[d], self.outstanding_tokens[d],
                                               self.outstanding[d], d))
        return min(healthy, key=lambda d: (self.outstanding_tokens[d], self.outstanding[d], d))

    async def flush_cache(self) -> None:
        """Every replica evicts the prompt-cache entries no running request holds."""
        for replica in range(len(self.outstanding)):
            await self._post(replica, FlushCache())
        if self.affinity is not None:  # nothing a replica held is cached any more
            self.affinity.clear()

    async def profile(self, msg: Profile) -> None:
        """Every replica's router passes the profiler's start or stop on to its workers, between steps."""
        for replica in range(len(self.outstanding)):
            await self._post(replica, msg)

    async def abort_all(self) -> None:
        groups = {id(r.group): r.group for r in self._routes.values()}
        for group in groups.values():
            await group.abort()

    async def fail_all(self, reason: str, error: str) -> None:
        """End every open request now with `reason`: each stream sends its error event and [DONE]
        (a drain that timed out), and the routers stop generating for nobody."""
        routes = list(self._routes.items())
        for request_id, route in routes:  # every client hears first: a router may be gone (a teardown)
            self._forget(request_id, route.group.replica)
            route.group._deliver(route.choice, TextDelta(request_id=request_id, text="", token_ids=[],
                                                         finish_reason=reason, error=error))
        for request_id, route in routes:
            await self._post(route.group.replica, AbortRequest(request_id=request_id))

    async def on_message(self, msg: FrontendInbound) -> None:
        if isinstance(msg, MetricsSnapshot):
            self._last_heartbeat = time.monotonic()
            self.metrics = msg
        elif isinstance(msg, TextBatch):
            for delta in msg.deltas:
                await self._on_delta(delta)

    async def _on_delta(self, delta: TextDelta) -> None:
        route = self._routes.get(delta.request_id)
        if route is None:
            return  # aborted or already finished: the router may still have had tokens in flight
        if route.prefill:  # its first answer: the prompt is prefilled
            self.pending_prefill[route.group.replica] -= route.prefill
            route.prefill = 0
        if delta.stopped_by_string and delta.finish_reason is None:
            delta.finish_reason = "stop"
        if delta.finish_reason is not None:
            self._forget(delta.request_id, route.group.replica)
            if delta.stopped_by_string:  # the detokenizer saw a stop string; the router has not
                await self._post(route.group.replica, AbortRequest(request_id=delta.request_id))
        route.group._deliver(route.choice, delta)

    def _forget(self, request_id: str, replica: int) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None:
            self.outstanding[replica] -= 1
            self.outstanding_tokens[replica] -= route.tokens
            self.pending_prefill[replica] -= route.prefill

    async def _abort(self, request_ids: list[str], replica: int) -> None:
        for request_id in request_ids:
            if request_id in self._routes:
                self._forget(request_id, replica)
                await self._post(replica, AbortRequest(request_id=request_id))


class ZmqEngineLink:
    """PUSH to `connects["requests.{d}"]` for each router replica d; PULL text and metrics on
    `binds["text"]`."""

    def __init__(self, ctx: zmq.asyncio.Context, spec: ProcessSpec):
        replicas = sorted(int(key.split(".", 1)[1]) for key in spec.connects if key.startswith("requests."))
        if replicas != list(range(len(replicas))) or not replicas:
            raise ValueError(f"{spec.name}: expected endpoints requests.0..requests.N-1, got {sorted(spec.connects)}")
        self.senders = [AsyncSender(ctx, spec.connects[f"requests.{d}"]) for d in replicas]
        self.receiver: AsyncReceiver[FrontendInbound] = AsyncReceiver(ctx, spec.binds["text"], FrontendInbound)

    @property
    def num_replicas(self) -> int:
        return len(self.senders)

    async def post(self, replica: int, msg: RouterInbound) -> None:
        await self.senders[replica].send(msg)

    async def pump(self, client: EngineClient) -> None:
        """The one reader of the PULL socket: hand every message to the client, forever."""
        while True:
            msg = await self.receiver.recv()
            try:
                await client.on_message(msg)
            except Exception:  # one bad message must not stop every other request's text
                log.exception("failed to handle %s", type(msg).__name__)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
        self.receiver.close()
