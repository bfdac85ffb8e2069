"""dp cache fetch (cache.dp_fetch): a replica's router, when a prompt's prefix is cached neither in its
GPU tree nor in its own host tier, takes the longest continuation that another replica on the host
holds in ITS host pool, found through the host-wide index (runtime/cache/host_index.py); the workers
copy those slots from that replica's pool file straight into their GPU KV (KvMove.replica) before the
step's forward, so the request starts with them computed.

The source slots are pinned from the lend until the step carrying the copy returns (its forward ran
after the copy). This router also owns its own pool's entries: it publishes a demoted node's keys once
the step that wrote them returned, and unpublishes a host slot before freeing it; a slot another
replica has pinned is kept out of the free list until the pins are gone."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from llaunch.runtime.cache.host_index import HostIndex
from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.cache.prefix_keys import BLOCK, token_keys
from llaunch.runtime.cache.prefix_tree import Node
from llaunch.runtime.ipc.messages import KvMove


@dataclass
class Fetch:
    replica: int  # whose host pool
    host_slots: list[int]  # there
    gpu_slots: list[int]  # here, slot i ← host_slots[i]


class FetchingHost(KvAllocator):
    """The own host pool's free list: a slot leaves the index before it is free, or waits for its pins."""

    def __init__(self, num_slots: int, fetch: "DpFetch"):
        super().__init__(num_slots)
        self.fetch = fetch

    def free(self, slots: list[int]) -> None:
        fetch = self.fetch
        fetch.generation[np.asarray(slots, dtype=np.int64)] += 1  # a publish planned before this is stale
        held = set(fetch.own.unpublish(slots))
        fetch.held.extend(s for s in slots if s in held)
        super().free([s for s in slots if s not in held])

    def free_unpinned(self) -> None:
        free = set(self.fetch.own.unpinned(self.fetch.held))
        if free:
            self.fetch.held = [s for s in self.fetch.held if s not in free]
            super().free(sorted(free))


class DpFetch:
    def __init__(self, rank: int, index_paths: list[str], host_slots: int, timeout_s: float = 300.0):
        self.rank = rank
        self.indexes = [HostIndex(p, host_slots, len(index_paths), timeout_s) for p in index_paths]
        self.own = self.indexes[rank]
        self.host = FetchingHost(host_slots, self)
        self.generation = np.zeros(host_slots, dtype=np.int64)  # per own host slot: frees so far
        self.held: list[int] = []  # own host slots freed while another replica had them pinned
        self.fetched = 0  # tokens since start (admitted requests)
        self._lent: dict[str, Fetch] = {}  # request id → fetch of a request not yet admitted
        self._admitted: list[Fetch] = []  # copies for the next plan
        self._demoted: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (slots, generations, keys)
        self._in_flight: deque = deque()  # per plan out: (its fetches, its demotions)

    # ---- fetching ---------------------------------------------------------------------------------

    def lend(self, req, have: int, want: int, room: int, alloc) -> list[int]:
        """GPU slots holding tokens req.prompt_ids[have:have+n] once the next plan's copies ran (n ≤ room),
        fetched from the replica holding the longest such run; [] when none holds a block's worth."""
        if want - have < BLOCK or room < BLOCK:
            return []
        if req.prefix_keys is None or len(req.prefix_keys) != want:  # hashed once: a waiting request retries every step
            req.prefix_keys = token_keys(req.prompt_ids, want)
        keys = req.prefix_keys[have:]
        request_id = req.id
        best, replica, source = 0, -1, None
        for r, index in enumerate(self.indexes):
            if r != self.rank:
                found = index.lookup(keys)
                run = len(found) if (found >= 0).all() else int(np.argmin(found >= 0))
                if run > best:
                    best, replica, source = run, r, found[:run]
        n = min(best, room)
        if n < BLOCK:
            return []
        n = self.indexes[replica].pin(self.rank, source[:n], keys[:n])
        if n == 0:
            return []
        fetch = Fetch(replica, source[:n].tolist(), alloc(n))
        self._lent[request_id] = fetch
        return fetch.gpu_slots

    def take_back(self, request_id: str, kv: KvAllocator) -> None:
        fetch = self._lent.pop(request_id, None)
        if fetch is not None:
            self.indexes[fetch.replica].unpin(self.rank, fetch.host_slots)
            kv.free(fetch.gpu_slots)

    def admitted(self, request_id: str) -> None:
        fetch = self._lent.pop(request_id, None)
        if fetch is not None:
            self._admitted.append(fetch)
            self.fetched += len(fetch.gpu_slots)

    def abandon(self) -> None:
        """The worker is gone (the scheduler failed every request): no plan out will return, so give
        the other replicas back every pin this one holds, or their slots stay held for good."""
        for fetch in [*self._lent.values(), *self._admitted, *(f for fs, _ in self._in_flight for f in fs)]:
            self.indexes[fetch.replica].unpin(self.rank, fetch.host_slots)
        self._lent, self._admitted, self._demoted = {}, [], []  # demotions not seen done are never published
        self._in_flight.clear()

    # ---- the own pool -------------------------------------------------------------------------------

    def demoted(self, node: Node) -> None:
        """A node moved to the own host pool (copied by the next plan): publish it once that returned."""
        parts, at = [], node
        while at.parent is not None:
            parts.append(at.tokens)
            at = at.parent
        tokens = [t for part in reversed(parts) for t in part]
        slots = np.asarray(node.slots, dtype=np.int64)
        self._demoted.append((slots, self.generation[slots].copy(), token_keys(tokens)[len(tokens) - len(slots):]))

    def peer_pinned(self, slots: list[int]) -> bool:
        """Whether another replica's fetch holds any of these own host slots now (read without the lock:
        a pin taken just after is still honoured, the slot then waits in `held`)."""
        return bool(self.own.pins[:, np.asarray(slots, dtype=np.int64)].any())

    # ---- per plan ---------------------------------------------------------------------------------

    def take_moves(self) -> list[KvMove]:
        """The fetch copies of the next plan (after its host-tier moves: a demotion may read a slot a
        fetch then writes)."""
        moves = [KvMove(to_host=False, gpu_slots=f.gpu_slots, host_slots=f.host_slots, replica=f.replica)
                 for f in self._admitted]
        self._in_flight.append((self._admitted, self._demoted))
        self._admitted, self._demoted = [], []
        return moves

    def returned(self) -> None:
        """The oldest plan out returned: its copies are done. Unpin what it fetched, publish what it
        demoted (unless freed since), free own slots no longer pinned."""
        fetches, demoted = self._in_flight.popleft() if self._in_flight else ([], [])
        for f in fetches:
            self.indexes[f.replica].unpin(self.rank, f.host_slots)
        for slots, generations, keys in demoted:
            same = self.generation[slots] == generations
            self.own.publish(slots[same], keys[same])
        if self.held:
            self.host.free_unpinned()
