"""The router's side of the host KV tier (cache.cpu_tokens > 0): PromptCache over a TieredPrefixTree
(runtime/cache/host_tier.py). Admission promotes the host-resident part of a request's cached prefix
back to GPU slots, as far as the GPU pool has room (free or evictable); the rest is computed again.
The copies ride on the next step's plan (StepPlan.kv_moves), which every tp rank applies before that
step's forward."""
from __future__ import annotations

from llaunch.runtime.cache.host_tier import TieredPrefixTree
from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.ipc.messages import KvMove
from llaunch.runtime.router.dp_fetch import DpFetch
from llaunch.runtime.router.prompt_cache import NoPromptCache, PromptCache
from llaunch.runtime.router.request import Request


def host_tier_stats(cache: NoPromptCache) -> dict[str, int]:
    """RouterStats' host-tier fields (none without the tier)."""
    if not isinstance(cache, TieredPromptCache):
        return {}
    return dict(host_cache_hits=cache.host_hits, host_cache_tokens=cache.tree.host_tokens,
                host_cache_slots=cache.host.num_slots, kv_promoted=cache.tree.promoted, kv_demoted=cache.tree.demoted,
                dp_fetched=cache.fetch.fetched if cache.fetch is not None else 0)


def prompt_cache_for(kv: KvAllocator, prompt_cache: bool, host_tokens: int, fetch_from=None) -> NoPromptCache:
    """`fetch_from`: (own dp rank, every replica's host index file) with cache.dp_fetch."""
    if not prompt_cache:
        return NoPromptCache(kv)
    if host_tokens <= 0:
        return PromptCache(kv)
    return TieredPromptCache(kv, host_tokens, DpFetch(fetch_from[0], list(fetch_from[1]), host_tokens) if fetch_from else None)


class TieredPromptCache(PromptCache):
    def __init__(self, kv: KvAllocator, host_tokens: int, fetch: DpFetch | None = None):
        NoPromptCache.__init__(self, kv)
        self.fetch = fetch  # cache.dp_fetch: misses are taken from other replicas' host pools
        self.host = fetch.host if fetch is not None else KvAllocator(host_tokens)
        self.tree = TieredPrefixTree(kv, self.host)
        if fetch is not None:
            self.tree.on_demote = fetch.demoted
            self.tree.on_short = fetch.host.free_unpinned  # an idle owner's held slots come back too
            self.tree.peer_pinned = fetch.peer_pinned
        self.host_hits = 0  # of `hits`: tokens admitted requests found in the host tier
        self._promoted: dict[str, int] = {}  # request id → tokens its lend promoted

    @property
    def host_tokens(self) -> int:
        return self.tree.host_tokens

    def lend(self, req: Request) -> None:
        shared = 0 if req.reads_whole_prompt else req.prompt_len - 1
        tree = self.tree
        slots, node = tree.match(req.prompt_ids[:shared])
        tree.lock(node)
        promoted = 0
        path = tree.host_path
        tree.pin(path)
        try:
            for host_node in path:  # top-down: each one's parent is on the GPU by now
                if len(host_node.slots) > self.kv.num_free + tree.num_evictable:
                    break  # no room: the rest of the prompt is computed
                tree.promote(host_node)
                tree.lock(host_node)
                tree.unlock(node)
                node = host_node
                slots = slots + host_node.slots
                promoted += len(host_node.slots)
        finally:
            tree.unpin()
        req.prefix_node, req.slots = node, slots
        req.num_cached = req.num_computed = len(slots)
        self._promoted[req.id] = promoted
        if self.fetch is not None and (not path or node is path[-1]):  # the whole local prefix is on the GPU
            # fetched slots are the request's own (computed, not cached): they join the tree at release
            fetched = self.fetch.lend(req, len(slots), shared,
                                      self.kv.num_free + tree.num_evictable, self.alloc)
            req.slots = slots + fetched
            req.num_computed += len(fetched)

    def take_back(self, req: Request) -> None:
        if self.fetch is not None:
            self.fetch.take_back(req.id, self.kv)
        super().take_back(req)
        self._promoted.pop(req.id, None)

    def admitted(self, req: Request) -> None:
        super().admitted(req)
        self.host_hits += self._promoted.pop(req.id, 0)
        if self.fetch is not None:
            self.fetch.admitted(req.id)

    def returned(self) -> None:
        if self.fetch is not None:
            self.fetch.returned()

    def abandon(self) -> None:
        if self.fetch is not None:
            self.fetch.abandon()

    def _duplicates(self, slots: list[int]) -> list[int]:
        adopted = self.tree.adopted  # they replaced host copies: the tree's now
        return [s for s in slots if s not in adopted]

    def take_moves(self) -> list[KvMove]:
        moves = [KvMove(to_host=t, gpu_slots=g, host_slots=h) for t, g, h in self.tree.take_moves()]
        return moves + self.fetch.take_moves() if self.fetch is not None else moves
