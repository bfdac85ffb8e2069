"""The router's side of the prompt cache: which KV a request borrows from the radix tree when it is
admitted, and what its sequence leaves there when it ends. `NoPromptCache` is the same interface
with the cache off (cache.prompt_cache=false), so the scheduler has one code path.

Pipelined steps: a request's sequence joins the tree only when it is released, i.e. once no step in
flight writes its KV; so the KV of a step still out is never matched, and an unlocked node is never
read by a step in flight (a request unlocks its prefix at release too).
"""
from __future__ import annotations

from typing import Optional

from llaunch.runtime.cache.kv_allocator import KvAllocator
from llaunch.runtime.cache.prefix_tree import PrefixTree
from llaunch.runtime.router.request import Request


class NoPromptCache:
    """Every request computes its whole prompt; its KV is freed when it ends."""

    tree: Optional[PrefixTree] = None

    def __init__(self, kv: KvAllocator):
        self.kv = kv
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries), at admission
        self.hits = 0  # of those, tokens reused (vLLM's prefix_cache_hits)

    @property
    def evictable(self) -> int:
        """Allocated slots that count as free: cache entries no request holds."""
        return 0

    @property
    def locked(self) -> int:
        """Cache entries requests hold, counted once however many share them."""
        return 0

    @property
    def tokens(self) -> int:
        return 0

    def alloc(self, n: int) -> list[int]:
        return self.kv.alloc(n)

    def lend(self, req: Request) -> None:
        """Before admission: give the request its cached prefix (slots, num_computed)."""

    def take_back(self, req: Request) -> None:
        """Undo `lend` for a request that stays waiting."""

    def admitted(self, req: Request) -> None:
        """Count the lookup of a request that was admitted."""

    def share_prompt(self, req: Request) -> None:
        """Its prompt's KV is computed: cache it now, before the request ends (diverse mode)."""

    def release(self, req: Request) -> None:
        """The request ended and no step in flight uses its KV."""
        self.kv.free(req.slots)

    def flush(self) -> int:
        return 0

    def take_moves(self) -> list:
        """Host-tier copies for the next plan (runtime/router/tiered_cache.py): none without one."""
        return []

    def returned(self) -> None:
        """The oldest plan out returned, its copies done (cache.dp_fetch: runtime/router/dp_fetch.py)."""

    def abandon(self) -> None:
        """The worker is gone: no plan out returns (cache.dp_fetch gives back its pins on other replicas)."""


class PromptCache(NoPromptCache):
    def __init__(self, kv: KvAllocator):
        super().__init__(kv)
        self.tree = PrefixTree(kv)

    @property
    def evictable(self) -> int:
        return self.tree.num_evictable

    @property
    def locked(self) -> int:
        return self.tree.num_locked

    @property
    def tokens(self) -> int:
        return self.tree.num_tokens

    def alloc(self, n: int) -> list[int]:
        """Admission counted unlocked entries as free: evict them when the free list runs short."""
        short = n - self.kv.num_free
        if short > 0:
            self.tree.evict(short)
        return self.kv.alloc(n)

    def lend(self, req: Request) -> None:
        # all but the last prompt token: it must be computed to sample the first output; a request
        # that reads every prompt position (prompt logprobs, mean pooling) computes its whole prompt (a cached
        # prefix has no logits or hidden states)
        shared = 0 if req.reads_whole_prompt else req.prompt_len - 1
        slots, node = self.tree.match(req.prompt_ids[:shared])
        self.tree.lock(node)
        req.prefix_node, req.slots = node, slots
        req.num_cached = req.num_computed = len(slots)

    def take_back(self, req: Request) -> None:
        self.tree.unlock(req.prefix_node)
        req.prefix_node, req.slots = None, []
        req.num_cached = req.num_computed = 0

    def admitted(self, req: Request) -> None:
        self.queries += req.prompt_len
        self.hits += req.num_cached

    def share_prompt(self, req: Request) -> None:
        """Insert the running request's prompt (all but its last token, what `lend` matches) and hold
        it in place of the prefix it borrowed, so requests with the same prompt borrow it now. Skipped
        where the tree holds more of the prompt than it lent (another request cached it meanwhile): the
        request's own slots for those tokens stay its own until it ends."""
        n = req.prompt_len - 1
        if req.prefix_node is None or n <= req.num_cached:
            return
        if len(self.tree.match(req.prompt_ids[:n])[0]) != req.num_cached:
            return
        self.tree.insert(req.prompt_ids[:n], req.slots[:n])
        _, node = self.tree.match(req.prompt_ids[:n])
        self.tree.lock(node)
        self.tree.unlock(req.prefix_node)
        req.prefix_node, req.num_cached = node, n

    def release(self, req: Request) -> None:
        """Insert what the request computed and unlock its prefix. Slots of tokens the tree holds
        already (another request cached them meanwhile), and of a token the router never saw (the
        input of a step planned after the request ended), go back to the allocator."""
        if req.prefix_node is None:  # never admitted
            self.kv.free(req.slots)
            return
        tokens = (req.prompt_ids + req.output_ids)[: len(req.slots)]
        known = len(tokens)
        self.kv.free(req.slots[known:])
        present = self.tree.insert(tokens, req.slots[:known])
        self.kv.free(self._duplicates(req.slots[req.num_cached : present]))
        self.tree.unlock(req.prefix_node)
        req.prefix_node = None

    def _duplicates(self, slots: list[int]) -> list[int]:
        """Of the request's slots for tokens the tree held already, those the tree did not keep."""
        return slots

    def flush(self) -> int:
        return self.tree.flush()
