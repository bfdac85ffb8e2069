"""The visual server's side of the embed cache: image embeddings by content hash in the blocks of a
shared-memory file, least recently used first out. An entry a request still needs is pinned (from
EncodeImages until the router's ReleaseImages), so it is never evicted or overwritten while a worker
may read it."""
from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass, field

from llaunch.runtime.cache.host_pool import create_pool, remove_pool
from llaunch.runtime.cache.embed_shm import BLOCK_BYTES


class TooLarge(ValueError):
    """One image's embeddings are larger than the whole cache."""


@dataclass
class Entry:
    blocks: list[int]
    pins: int = 0
    holders: set = field(default_factory=set)  # the requests that pinned it


class EmbedStore:
    def __init__(self, path: str, blocks: int):
        self.path = path
        st = os.statvfs(os.path.dirname(path))
        if blocks * BLOCK_BYTES > st.f_bavail * st.f_frsize:  # else a write past the tmpfs's end: SIGBUS
            raise RuntimeError(f"{os.path.dirname(path)} has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free; the "
                               f"embed cache needs {blocks * BLOCK_BYTES / 2**20:.0f} MiB: lower visual.embed_cache_mib "
                               "(or enlarge the tmpfs, e.g. docker --shm-size)")
        create_pool(path, blocks * BLOCK_BYTES)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, blocks * BLOCK_BYTES)
        finally:
            os.close(fd)
        self.capacity = blocks
        self._free = list(range(blocks - 1, -1, -1))
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.pins)

    def pin(self, key: str, holder) -> list[int]:
        """Mark `key` used (most recent) and held by `holder`; its blocks."""
        e = self._entries[key]
        self._entries.move_to_end(key)
        if holder not in e.holders:
            e.holders.add(holder)
            e.pins += 1
        return e.blocks

    def unpin(self, key: str, holder) -> None:
        e = self._entries.get(key)
        if e is not None and holder in e.holders:
            e.holders.discard(holder)
            e.pins -= 1

    def put(self, key: str, data: memoryview) -> bool:
        """Write `data` (bytes) under `key`; False when the room is held by pinned entries (try again
        after a release). Raises TooLarge when it could never fit."""
        if key in self._entries:
            return True
        need = -(-len(data) // BLOCK_BYTES)
        if need > self.capacity:
            raise TooLarge(f"an image's embeddings take {len(data) / 2**20:.1f} MiB, more than the whole embed "
                           f"cache ({self.capacity * BLOCK_BYTES / 2**20:.0f} MiB): raise visual.embed_cache_mib")
        if len(self._free) < need:
            evictable = sum(len(e.blocks) for e in self._entries.values() if not e.pins)
            if len(self._free) + evictable < need:
                return False
            for old in [k for k, e in self._entries.items() if not e.pins]:  # oldest first
                self._free += self._entries.pop(old).blocks
                if len(self._free) >= need:
                    break
        blocks = [self._free.pop() for _ in range(need)]
        for i, b in enumerate(blocks):
            part = data[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]
            self._map[b * BLOCK_BYTES:b * BLOCK_BYTES + len(part)] = part
        self._entries[key] = Entry(blocks)
        return True

    def close(self) -> None:
        self._map.close()
        remove_pool(self.path)
