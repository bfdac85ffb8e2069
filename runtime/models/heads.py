"""How attention heads spread over tensor-parallel ranks, padding with zero heads when they do not split.

KV heads are split over ranks, or replicated when ranks outnumber them (each KV head then lives on
tp / kv consecutive ranks). When neither divides (SmolLM2: 9 query / 3 KV heads at tp2), or a KV
head's query group does not split over its replicas (Qwen2-7B: 7 per group at tp8), the layout adds
heads whose weights are zero: a zero query row, key and value give a zero attention output, and the
zero columns of o_proj drop it, so the result is exact and only the work grows. The launcher allows
padding only with `parallel.pad_heads=true`.

Heads are numbered in padded order, group by group: padded query head p reads padded KV head
p // group, so every rank's local heads keep the plain grouped-query mapping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class HeadLayout:
    num_heads: int  # real query heads
    num_kv_heads: int  # real KV heads
    tp: int
    padded_kv_heads: int
    padded_group: int  # padded query heads per KV head

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: int) -> "HeadLayout":
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        kv = num_kv_heads if (num_kv_heads % tp == 0 or tp % num_kv_heads == 0) else _ceil_to(num_kv_heads, tp)
        replicas = max(1, tp // kv)  # ranks sharing one KV head
        return cls(num_heads, num_kv_heads, tp, kv, _ceil_to(num_heads // num_kv_heads, replicas))

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def padded_heads(self) -> int:
        return self.padded_kv_heads * self.padded_group

    @property
    def padded(self) -> bool:
        return self.padded_heads != self.num_heads

    @property
    def heads_per_rank(self) -> int:
        return self.padded_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.padded_kv_heads // self.tp)

    def kv_start(self, rank: int) -> int:
        """This rank's first padded KV head (replicated heads: the one its query heads read)."""
        if self.padded_kv_heads >= self.tp:
            return rank * self.kv_heads_per_rank
        return rank * self.padded_kv_heads // self.tp

    def real_head(self, p: int) -> Optional[int]:
        """The checkpoint query head at padded index p, or None for a zero head."""
        kv, i = divmod(p, self.padded_group)
        return kv * self.group + i if kv < self.num_kv_heads and i < self.group else None

    def real_kv_head(self, j: int) -> Optional[int]:
        return j if j < self.num_kv_heads else None

    def query_runs(self, rank: int) -> list[tuple[Optional[int], int]]:
        """This rank's query heads as runs of (first checkpoint head or None for zeros, count)."""
        first = rank * self.heads_per_rank
        return _runs([self.real_head(p) for p in range(first, first + self.heads_per_rank)])

    def kv_runs(self, rank: int) -> list[tuple[Optional[int], int]]:
        start = self.kv_start(rank)
        return _runs([self.real_kv_head(j) for j in range(start, start + self.kv_heads_per_rank)])


def _runs(heads: list[Optional[int]]) -> list[tuple[Optional[int], int]]:
    """[0, 1, 2, None, None] → [(0, 3), (None, 2)]: consecutive checkpoint heads, and zero heads."""
    runs: list[tuple[Optional[int], int]] = []
    for h in heads:
        if runs:
            start, n = runs[-1]
            if (h is None and start is None) or (h is not None and start is not None and h == start + n):
                runs[-1] = (start, n + 1)
                continue
        runs.append((h, 1))
    return runs
