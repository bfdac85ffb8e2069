"""What the GPU checks share: a checkpoint read straight from a transformers model, forward batches
written out by hand, and agreement of argmax lists."""
from __future__ import annotations

import torch

from llaunch.runtime.models.batch import ForwardBatch
from llaunch.runtime.models.weights import _slice


class StateDictSource:
    """Checkpoint tensors straight from a transformers model (no files)."""

    def __init__(self, state):
        self.state = state

    def has(self, name):
        return name in self.state

    def read(self, shard):
        return _slice(self.state[shard.name], shard)

    def close(self):
        pass


def batch_of(ids, positions, slots, rows, lens, prefill=None, device="cuda") -> ForwardBatch:
    """A decode step of len(ids) rows, or (prefill = its row) one prompt prefilled whole."""
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    if prefill is None:
        return ForwardBatch(t(ids), t(positions), t(slots), t(rows), t(lens), t([]), t([]), t([]), t([]),
                            t(list(range(len(ids)))), len(ids), 0, 0, max(lens))
    n = len(ids)
    return ForwardBatch(t(ids), t(positions), t(slots), t([]), t([]), t([prefill]), t([0]), t([n]), t([0]),
                        t(list(range(n))), 0, n, n, 0)


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)
