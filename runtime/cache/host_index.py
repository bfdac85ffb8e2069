"""The host-wide index of the host KV tier (cache.dp_fetch): one shared-memory file per dp replica,
made by the kv_host process, through which a replica that misses a prefix takes it from another
replica's host pool instead of computing it again (the seed's enable_dp_prompt_cache_fetch).

A replica's file holds, over its host slots:
- `stamps[slot]`: the key of the token whose K/V the slot holds (runtime/cache/prefix_keys.py), set by
  its router once the step that wrote the slot returned, cleared (0) before the slot is freed;
- a lookup table key → slot (WAYS-way associative: a publish takes a stale or empty entry of its
  bucket, else overwrites one; stale entries fail the stamp check, so the table never needs deletes);
- `pins[fetcher, slot]`: copies of the slot other replicas have planned and not yet seen done, each
  fetcher writing only its own row.
Pinning: a fetcher checks the stamps and pins under the file's lock; the owner clears the stamps and
reads the pins under the same lock before it frees a slot, and keeps a pinned one out of its free list
until the pins are gone. So a pinned slot holds its key's K/V until the fetch copy is done.
"""
from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager

import numpy as np

WAYS = 8  # table entries a key may sit in (consecutive ones)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the bucket comes from all of the key's bits


def table_size(slots: int) -> int:
    """Lookup-table entries: a power of two, at least 4x the slots (a full bucket is rare)."""
    return 1 << max(4 * slots - 1, 1).bit_length()


def index_bytes(slots: int, replicas: int) -> int:
    return 8 * slots + 16 * table_size(slots) + 4 * replicas * slots


class HostIndex:
    def __init__(self, path: str, slots: int, replicas: int, timeout_s: float = 300.0):
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):  # the kv_host process makes it as the graph starts
            if time.monotonic() > deadline:
                raise RuntimeError(f"the host KV index {path} did not appear within {timeout_s:.0f}s (is kv_host up?)")
            time.sleep(0.05)
        self.path, self.slots, self.replicas = path, slots, replicas
        size = table_size(slots)
        mem = np.memmap(path, dtype=np.uint8, mode="r+", shape=(index_bytes(slots, replicas),))
        self.stamps = mem[: 8 * slots].view(np.uint64)
        table = mem[8 * slots : 8 * slots + 16 * size].view(np.uint64).reshape(size, 2)
        self.table_keys, self.table_slots = table[:, 0], table[:, 1]
        self.pins = mem[8 * slots + 16 * size :].view(np.int32).reshape(replicas, slots)
        self._shift = np.uint64(64 - (size.bit_length() - 1))
        self._mask = size - 1
        self._fd = os.open(path, os.O_RDWR)

    @contextmanager
    def locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # a syscall each side: the stores before it are seen after it
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- the owner ----------------------------------------------------------------------------

    def _bucket(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _MIX) >> self._shift).astype(np.int64)

    def publish(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """The slots hold these keys' K/V (written by a step that returned): fetchable from now on."""
        keep = keys != 0
        slots, keys = slots[keep].astype(np.int64), keys[keep]
        self.stamps[slots] = keys
        base = self._bucket(keys)
        for way in range(WAYS):  # each key takes the first free way of its bucket (the last way: by force)
            at = (base + way) & self._mask
            old = self.table_keys[at]
            free = (old == 0) | (old == keys) | (self.stamps[self.table_slots[at].astype(np.int64)] != old)
            if way == WAYS - 1:
                free[:] = True
            self.table_keys[at[free]] = keys[free]
            self.table_slots[at[free]] = slots[free].astype(np.uint64)
            placed = self.table_keys[at] == keys  # two keys of this batch on one entry: the last one won
            slots, keys, base = slots[~placed], keys[~placed], base[~placed]
            if not len(keys):
                return

    def unpublish(self, slots: list[int]) -> list[int]:
        """Before freeing `slots`: no new fetch can pin them; those pinned now (returned) must wait."""
        if not slots:
            return []
        at = np.asarray(slots, dtype=np.int64)
        with self.locked():
            self.stamps[at] = 0
            pinned = self.pins[:, at].sum(axis=0) > 0
        return at[pinned].tolist()

    def unpinned(self, slots: list[int]) -> list[int]:
        """Of slots kept back by `unpublish`, those no fetch holds any more (free to reuse)."""
        if not slots:
            return []
        at = np.asarray(slots, dtype=np.int64)
        with self.locked():
            free = self.pins[:, at].sum(axis=0) == 0
        return at[free].tolist()

    # ---- a fetcher ------------------------------------------------------------------------------

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Per key, the slot the table names for it (-1: none); the stamps decide under `pin`."""
        found = np.full(len(keys), -1, dtype=np.int64)
        base = self._bucket(keys)
        for way in range(WAYS):
            at = (base + way) & self._mask
            hit = (self.table_keys[at] == keys) & (keys != 0) & (found < 0)
            found[hit] = self.table_slots[at[hit]].astype(np.int64)
        return found

    def pin(self, fetcher: int, slots: np.ndarray, keys: np.ndarray) -> int:
        """Pin the longest leading run of `slots` that still holds `keys`; its length."""
        with self.locked():
            ok = self.stamps[slots] == keys
            n = len(ok) if ok.all() else int(np.argmin(ok))
            np.add.at(self.pins[fetcher], slots[:n], 1)
        return n

    def unpin(self, fetcher: int, slots: list[int]) -> None:
        np.add.at(self.pins[fetcher], np.asarray(slots, dtype=np.int64), -1)  # own row: no lock needed

    def close(self) -> None:
        os.close(self._fd)
