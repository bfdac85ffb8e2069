"""The host KV tier (cache.cpu_tokens): a second level of the prompt cache in host memory, below the
GPU radix tree (the seed's enable_cpu_cache). When the tree must free GPU slots, its least recently
used unreferenced nodes are demoted to host slots instead of dropped; a later prompt whose prefix
runs into host-resident nodes gets them promoted back to fresh GPU slots. The host pool, when full,
drops its own least recently used leaves: LRU across both tiers.

Every node lives in exactly one tier (`Node.on_host`), and GPU nodes are closed upwards: a host
node's descendants are host nodes too, so a match is a GPU prefix followed by a host continuation.
The copies are the workers' job: the tree records them in order (`moves`, each (to_host, gpu slots,
host slots)); the workers apply them in that order before the step's forward, so a slot freed by one
move and reused by a later one of the same plan is read before it is written. Pure logic: token ids
and slot ids, no tensors.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.cache.prefix_tree import Node, PrefixTree

Move = tuple[bool, list[int], list[int]]  # (to_host, gpu slots, host slots), slot i → slot i


class TieredPrefixTree(PrefixTree):
    """`num_tokens` / `num_locked` / `num_evictable` count GPU slots only, as the scheduler expects."""

    def __init__(self, allocator: KvAllocator, host: KvAllocator):
        super().__init__(allocator)
        self.host = host
        self.host_tokens = 0  # host slots the tree holds
        self.moves: list[Move] = []  # copies for the workers, taken with each step's plan
        self.host_path: list[Node] = []  # set by match: host nodes continuing the matched GPU prefix
        self.adopted: set[int] = set()  # set by insert: caller's slots that replaced host copies
        self.demoted = self.promoted = self.dropped = 0  # tokens since start
        self._pinned: set[int] = set()  # ids of host nodes being promoted: never dropped meanwhile
        self._dropping = False  # flush: evicted GPU nodes are dropped, not demoted
        self._host_heap: list | None = None  # host leaves by age, during one evict (see _drop_host)
        self.on_demote = None  # called with each node demoted (cache.dp_fetch publishes its keys)
        self.on_short = None  # called when the host pool lacks room (cache.dp_fetch frees held slots no pin holds)
        self.peer_pinned = None  # whether another replica pins any of these host slots (cache.dp_fetch)
        self._host_room: int | None = None  # host slots drops can free at most, once one evict found it short

    # ---- lookup -----------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
        """The GPU slots of the longest cached prefix that lives on the GPU and the node it ends at;
        the host-resident nodes that continue it are left in `host_path` (to promote)."""
        node, slots = self.root, []
        self.host_path = []
        for child in self._walk(tokens):
            if child.on_host:
                self.host_path.append(child)
            else:
                slots.extend(child.slots)
                node = child
        return slots, node

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """PrefixTree.insert; a host node on the way is replaced by the caller's GPU slots for the
        same tokens (it computed them again): those slots are the tree's now, listed in `adopted`."""
        self.adopted = set()
        return super().insert(tokens, slots)

    def _passed(self, node: Node, slots: Sequence[int]) -> None:
        if node.on_host:
            self.host.free(node.slots)
            self.host_tokens -= len(slots)
            node.slots, node.on_host = list(slots), False
            self.num_tokens += len(slots)
            self.adopted.update(node.slots)

    # ---- promotion --------------------------------------------------------------------------------

    def pin(self, nodes: list[Node]) -> None:
        self._pinned = {n.id for n in nodes}

    def unpin(self) -> None:
        self._pinned = set()

    def promote(self, node: Node) -> None:
        """Move a host node whose parent is on the GPU to fresh GPU slots (evicting, i.e. demoting,
        unreferenced GPU nodes if the free list runs short: the caller checked that enough are)."""
        n = len(node.slots)
        short = n - self.allocator.num_free
        if short > 0:
            self.evict(short)
        gpu = self.allocator.alloc(n)
        self.moves.append((False, gpu, node.slots))
        self.host.free(node.slots)
        node.slots, node.on_host = gpu, False
        self.host_tokens -= n
        self.num_tokens += n
        self.promoted += n

    # ---- eviction ---------------------------------------------------------------------------------

    def _gpu_evictable(self, node: Node) -> bool:
        return not node.on_host and node.refs == 0 and all(c.on_host for c in node.children.values())

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` GPU slots, least recently used unreferenced nodes with no GPU
        child first, demoting each to the host tier (or dropping it where the host tier cannot take
        it). Returns the GPU slots freed."""
        heap = [(n.last_used, n.id, n) for n in self.nodes() if self._gpu_evictable(n)]
        heapq.heapify(heap)
        self._host_heap, self._host_room = None, None  # built once per call, when the host tier first needs room
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node.slots)
            self.num_tokens -= len(node.slots)
            parent = node.parent
            self._demote_or_drop(node)
            if parent is not self.root and self._gpu_evictable(parent):
                heapq.heappush(heap, (parent.last_used, parent.id, parent))
        return freed

    def _demote_or_drop(self, node: Node) -> None:
        n = len(node.slots)
        if not self._dropping and self.host.num_free < n and self.on_short is not None:
            self.on_short()
        # room is measured, not counted: a dropped slot another dp replica has pinned is not free yet
        while not self._dropping and self.host.num_free < n and self._drop_host(n - self.host.num_free):
            pass
        if self._dropping or self.host.num_free < n:  # the host tier cannot take it: gone, with the host nodes under it
            self.allocator.free(node.slots)
            self.dropped += n
            self._remove(node)
            return
        host = self.host.alloc(n)
        self.moves.append((True, node.slots, host))
        self.allocator.free(node.slots)
        node.slots, node.on_host = host, True
        self.host_tokens += n
        self.demoted += n
        if self.on_demote is not None:
            self.on_demote(node)

    def _drop_host(self, num_tokens: int, whole: bool = True) -> int:
        """Free at least `num_tokens` host slots, least recently used host leaves first. The queue
        persists through one `evict` (one scan of the tree, not one per demotion); an entry that stopped
        being a droppable leaf meanwhile is skipped. `whole` (a demotion's room): all or nothing, checked
        before anything is dropped, so a demotion that cannot fit drops no cached entry for nothing; a
        leaf another replica pins is kept (dropping it frees no slot while the pin lasts)."""
        if whole and self._host_room is not None and num_tokens > self._host_room:
            return 0
        if self._host_heap is None:
            self._host_heap = [(n.last_used, n.id, n) for n in self.nodes() if self._droppable(n)]
            heapq.heapify(self._host_heap)
        heap = self._host_heap
        chosen: list[Node] = []
        kept: list = []
        gone: set[int] = set()
        freed = 0
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            leaf = entry[2]
            if not self._droppable(leaf, gone):
                continue
            if whole and self.peer_pinned is not None and self.peer_pinned(leaf.slots):
                kept.append(entry)
                continue
            chosen.append(leaf)
            gone.add(leaf.id)
            freed += len(leaf.slots)
            if self._droppable(leaf.parent, gone):
                heapq.heappush(heap, (leaf.parent.last_used, leaf.parent.id, leaf.parent))
        for entry in kept:
            heapq.heappush(heap, entry)
        if whole and freed < num_tokens:  # it cannot fit: keep every entry
            for leaf in chosen:
                heapq.heappush(heap, (leaf.last_used, leaf.id, leaf))
            self._host_room = freed
            return 0
        for leaf in chosen:  # leaves before their parents
            self.dropped += len(leaf.slots)
            self._remove(leaf)
        if self._host_room is not None:
            self._host_room -= freed
        return freed

    def _droppable(self, node: Node, gone: set[int] = frozenset()) -> bool:
        """A host leaf still in the tree (once the nodes in `gone` are dropped), not being promoted."""
        # `gone`: a parent queued again after its children were taken back can sit in the queue twice
        return (node.on_host and node.id not in gone and all(c.id in gone for c in node.children.values())
                and node.id not in self._pinned
                and node.parent is not None and node.parent.children.get(node.tokens[0]) is node)

    def _remove(self, node: Node) -> None:
        """Detach a node whose own slots the caller freed; the host nodes below it go too."""
        del node.parent.children[node.tokens[0]]
        node.parent = None  # detached: a queued entry for it (or below it) is stale
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            self.host.free(below.slots)
            self.host_tokens -= len(below.slots)
            below.parent = None
            stack.extend(below.children.values())
        if node.on_host:
            self.host.free(node.slots)
            self.host_tokens -= len(node.slots)

    def flush(self) -> int:
        """Drop everything no request holds, in both tiers; returns the GPU slots freed."""
        self._dropping = True
        try:
            freed = self.evict(self.num_evictable)
        finally:
            self._dropping = False
        self._host_heap, self._host_room = None, None
        self._drop_host(self.host_tokens, whole=False)
        return freed

    def take_moves(self) -> list[Move]:
        """The copies recorded since the last call, consecutive ones of one direction merged unless
        they write a slot twice (one freed by a drop in between and reused: the later write wins)."""
        merged: list[Move] = []
        written: set[int] = set()
        for to_host, gpu, host in self.moves:
            targets = host if to_host else gpu
            if merged and merged[-1][0] == to_host and written.isdisjoint(targets):
                merged[-1][1].extend(gpu)
                merged[-1][2].extend(host)
                written.update(targets)
            else:
                merged.append((to_host, list(gpu), list(host)))
                written = set(targets)
        self.moves = []
        return merged
