"""Prefix-aware dp routing (router.dp_prefix_affinity): a frontend remembers which replica it sent
each prompt prefix to, so the next turn of a conversation (its history + a new message) goes where the
history's KV is cached, in the GPU prompt cache or the host tier below it (cache.cpu_tokens), instead
of being recomputed on another replica. Prefixes are keyed by chained hashes of whole blocks of
BLOCK tokens, in an LRU of `capacity` blocks. Each frontend keeps its own map (HTTP workers do not
share one), so with several HTTP workers the affinity is per worker."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

BLOCK = 64  # tokens per hashed block: a shared prefix shorter than one block does not count


class PrefixAffinity:
    def __init__(self, capacity: int = 1 << 17, block: int = BLOCK):
        self.capacity = capacity
        self.block = block
        self._owner: OrderedDict[int, int] = OrderedDict()  # chained block hash → replica

    def _hashes(self, ids: Sequence[int]) -> list[int]:
        out, h = [], 0
        for end in range(self.block, len(ids) + 1, self.block):
            h = hash((h, tuple(ids[end - self.block : end])))
            out.append(h)
        return out

    def holder(self, ids: Sequence[int]) -> Optional[tuple[int, int]]:
        """(replica, tokens) of the longest remembered prefix of `ids`, or None."""
        hashes = self._hashes(ids)
        for n in range(len(hashes), 0, -1):
            replica = self._owner.get(hashes[n - 1])
            if replica is not None:
                return replica, n * self.block
        return None

    def record(self, ids: Sequence[int], replica: int) -> None:
        for h in self._hashes(ids):
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def clear(self) -> None:
        self._owner.clear()
