"""The prompt cache: a radix tree over token ids whose nodes own the KV slots of those tokens, so a
request whose prompt starts like an earlier sequence reuses that KV instead of computing it again
(SGLang's RadixCache, token-granular like LightLLM's).

Requests lock the path they reuse (reference counts along it, up to the root); unreferenced nodes
stay cached until the allocator needs room, then the least recently used leaves go first. Every
unreferenced node is evictable: a node's descendants are never locked when it is not, since a lock
covers the whole path. Pure logic: token ids and slot ids, no tensors.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterator, Optional, Sequence

from llaunch.runtime.cache.kv_allocator import KvAllocator


class Node:
    __slots__ = ("tokens", "slots", "children", "parent", "refs", "last_used", "id", "on_host")

    def __init__(self, tokens: list[int], slots: list[int], parent: Optional["Node"], node_id: int):
        self.tokens = tokens  # the edge from the parent: these token ids ...
        self.slots = slots  # ... and the KV slots holding them, one each
        self.children: dict[int, Node] = {}  # by first token
        self.parent = parent
        self.refs = 0  # requests whose reused prefix runs through this node
        self.last_used = 0  # logical clock of the last match/insert through it
        self.id = node_id  # tie-break for equal clocks, so eviction order is deterministic
        self.on_host = False  # its slots are host-tier slots (runtime/cache/host_tier.py), not GPU ones

    def __repr__(self) -> str:
        return f"Node({self.tokens}, slots={self.slots}, refs={self.refs})"


def _common_len(edge: list[int], tokens: Sequence[int], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    i = 0
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self, allocator: KvAllocator):
        self.allocator = allocator  # evicted slots go back here
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.root = Node([], [], None, next(self._ids))
        self.num_tokens = 0  # slots the tree holds
        self.num_locked = 0  # of those, tokens on a path some request holds

    @property
    def num_evictable(self) -> int:
        return self.num_tokens - self.num_locked

    # ---- lookup and insertion --------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
        """The slots of the longest cached prefix of `tokens`, and the node it ends at (a node is
        split when the prefix ends inside its edge, so the caller can lock exactly that prefix)."""
        node, slots = self.root, []
        for node in self._walk(tokens):
            slots.extend(node.slots)
        return slots, node

    def _walk(self, tokens: Sequence[int]) -> Iterator[Node]:
        """The nodes of the longest cached prefix of `tokens`, from the root down, each marked used now
        (the last one split first where the prefix ends inside its edge)."""
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return
            n = _common_len(child.tokens, tokens, i)
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = now
            yield child
            node, i = child, i + n

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache `tokens` with their `slots`. Returns how many leading tokens were cached already:
        the tree keeps its own slots for those, so the caller frees its duplicates among
        slots[:returned] (the tree owns the rest from now on)."""
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = Node(list(tokens[i:]), list(slots[i:]), node, next(self._ids))
                leaf.last_used = now
                node.children[tokens[i]] = leaf
                self.num_tokens += len(leaf.tokens)
                return i
            n = _common_len(child.tokens, tokens, i)
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = now
            self._passed(child, slots[i : i + n])
            node, i = child, i + n
        return i

    def _passed(self, node: Node, slots: Sequence[int]) -> None:
        """insert walked through `node`, whose tokens the caller also computed into `slots` (a tier
        below the GPU takes them instead of its own copy: runtime/cache/host_tier.py)."""

    def _split(self, child: Node, n: int) -> Node:
        """Cut child's edge after n tokens; the new upper node inherits its references."""
        upper = Node(child.tokens[:n], child.slots[:n], child.parent, next(self._ids))
        upper.refs, upper.last_used, upper.on_host = child.refs, child.last_used, child.on_host
        child.parent.children[upper.tokens[0]] = upper
        child.tokens, child.slots, child.parent = child.tokens[n:], child.slots[n:], upper
        upper.children[child.tokens[0]] = child
        return upper

    # ---- reference counts --------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """A request uses the prefix ending at `node`: nothing on the path may be evicted."""
        while node is not self.root:
            if node.refs == 0:
                self.num_locked += len(node.tokens)
            node.refs += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.refs <= 0:
                raise RuntimeError(f"unlock of an unlocked prefix node {node}")
            node.refs -= 1
            if node.refs == 0:
                self.num_locked -= len(node.tokens)
            node = node.parent

    # ---- eviction ----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (fewer only when that is all that is evictable),
        least recently used unreferenced leaves first; a parent left childless joins the queue.
        Returns the number of slots freed."""
        heap = [(n.last_used, n.id, n) for n in self.nodes() if not n.children and n.refs == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.slots)
            freed += len(leaf.slots)
            self.num_tokens -= len(leaf.slots)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, parent.id, parent))
        return freed

    def flush(self) -> int:
        """Evict everything no request holds; returns the slots freed."""
        return self.evict(self.num_evictable)

    # ---- inspection ----------------------------------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_slots(self) -> list[int]:
        return [s for node in self.nodes() for s in node.slots]
