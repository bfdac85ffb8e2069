"""Image embeddings by content hash, least recently used first out, bounded in bytes: a repeated image
is encoded once while it stays cached. Counts hits and misses for /metrics."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch


class EmbedCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Optional[torch.Tensor]:
        t = self._entries.get(key)
        if t is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return t

    def put(self, key: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if key in self._entries or size > self.max_bytes:
            return
        while self._entries and self.bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._entries[key] = t
        self.bytes += size

    def __len__(self) -> int:
        return len(self._entries)
