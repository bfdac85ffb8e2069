"""Token-granular KV slot allocation (LightLLM's TokenAttention): every cached token owns one slot."""
from __future__ import annotations


class OutOfSlots(RuntimeError):
    pass


class KvAllocator:
    """A free list of slot ids. Slots come out in ascending order from a fresh allocator, and freed
    slots are reused most-recent-first, so tests can assert exact ids."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"KV cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() yields 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlots(f"asked for {n} KV slots, {len(self._free)} free of {self.num_slots}")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))
