"""Pooling of an embedding model (model.task=embed): a prompt's final-norm hidden states as one vector, as
sentence-transformers' Pooling module computes them: the last position's, the mean over all, or the first's.

The model's head for such a model is `HiddenHead` (the norm's output as it is). Last pooling reads the prompt's
last position, which the step computes anyway (its sampled row). Mean and CLS pooling read positions of every chunk
of a prompt (chunked prefill): `PooledRows` adds them up per batch row as the chunks run, and the row's vector is
ready with its last chunk, so a prompt of any length is pooled whole with the same chunks as any other. Such a
request is never lent a cached prefix (the router's Request.reads_whole_prompt): those positions would be missing.
Normalization and Matryoshka truncation are the frontend's (runtime/http/embeddings_api.py): truncate, then
normalize, per request."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from llaunch.runtime.config import Pooling


class HiddenHead(nn.Module):
    """An embedding model's head: the final norm's output, float32. No weights (the checkpoint is a base model)."""

    def checkpoint_shards(self) -> dict:
        return {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


class PooledRows:
    """Per-row float32 sums [max_rows, hidden] for mean and CLS pooling (last pooling keeps none)."""

    def __init__(self, pooling: Pooling, max_rows: int, hidden_size: int, device: torch.device):
        self.pooling = Pooling(pooling)
        self.device = device
        self.sums: Optional[torch.Tensor] = None
        if self.pooling != Pooling.last:
            self.sums = torch.zeros((max_rows, hidden_size), dtype=torch.float32, device=device)
        self.prompt_len = [0] * max_rows

    @property
    def reads_chunks(self) -> bool:
        """Positions other than a prompt's last are pooled."""
        return self.sums is not None

    def start(self, row: int, prompt_len: int, cached: int) -> None:
        if cached and self.reads_chunks:  # the router lends no prefix to such requests: a bug if it did
            raise RuntimeError(f"row {row}: {cached} cached prompt tokens, but {self.pooling.value} pooling reads "
                               "every prompt position")
        self.prompt_len[row] = prompt_len
        if self.sums is not None:
            self.sums[row].zero_()

    def positions(self, start: int, n: int) -> int:
        """How many of a chunk's positions [start, start + n) are pooled, from its first on."""
        if self.pooling == Pooling.mean:
            return n
        if self.pooling == Pooling.cls:
            return 1 if start == 0 and n else 0
        return 0

    def add(self, hidden: torch.Tensor, parts: list[tuple[int, int]]) -> None:
        """`hidden` [P, H]: this step's pooled positions, for (row, count) in order."""
        at = 0
        for row, n in parts:
            self.sums[row] += hidden[at:at + n].sum(0)
            at += n

    def pooled(self, rows: list[int], last: torch.Tensor) -> torch.Tensor:
        """The vectors [len(rows), H] of rows whose prompt's last chunk ran; `last`: their last positions' states."""
        if self.sums is None:
            return last
        out = self.sums[torch.tensor(rows, dtype=torch.int64, device=self.device)]
        if self.pooling == Pooling.mean:
            lens = torch.tensor([self.prompt_len[r] for r in rows], dtype=torch.float32, device=self.device)
            out = out / lens[:, None]
        return out
