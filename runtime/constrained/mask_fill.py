"""A step's token bitmask from its rows' constraints (row_state.py), made on the host while the
device runs the step's forward: the grammar rows are filled together by xgrammar's batch matcher
(C++, no GIL), the other exclusions row by row, into one of two pinned buffers kept for the worker's
life and reset with a memset. The step used to build its mask with `torch.full` (an OpenMP fill:
~9-12 ms for 64 rows of a 152k vocabulary on a busy host, against 0.3 ms for the memset) and fill
one row per xgrammar call: 9.35 ms of host time a decode step at c64 on the H200 host, behind a
5.5 ms device step, so JSON-constrained c64 ran 24% below plain c64."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from llaunch.runtime.constrained.row_state import RowConstraint

MAX_FILL_THREADS = 4  # 64 grammar rows take ~0.6 ms on one thread: more threads only contend


class StepMasks:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, threads: Optional[int] = None):
        """`threads`: the batch matcher's threads (default: half this machine's cores, at most 4)."""
        self.device = device
        self.max_rows, self.words = max_rows, (vocab_size + 31) // 32
        # two buffers (made on the first constrained step): a step's copy to the device may still be
        # queued while the next step fills
        self._host: list[torch.Tensor] = []
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._turn = 0
        cores = os.cpu_count() or 1
        self._threads = max(1, min(threads or cores // 2, cores, MAX_FILL_THREADS))
        self._batch = None  # xgrammar's BatchGrammarMatcher, made on the first grammar row

    def fill(self, constraints: list[tuple[int, RowConstraint, int]], num_rows: int) -> torch.Tensor:
        """The bitmask [num_rows, words] on the device for a step of `num_rows` sampled rows, where
        `constraints` holds (index among them, constraint, tokens generated so far) of the
        constrained ones; the other rows allow every token."""
        host = self._buffer(num_rows)[:num_rows]
        words = host.numpy().view(np.uint32)
        words.fill(0xFFFFFFFF)  # all allowed; a grammar row is overwritten whole below
        matchers, at = [], []
        for i, constraint, _ in constraints:
            matcher = constraint.live_matcher()
            if matcher is not None:
                matchers.append(matcher)
                at.append(i)
        if matchers:
            self._batch_matcher().batch_fill_next_token_bitmask(matchers, host, at)
        for i, constraint, generated in constraints:
            if constraint.has_extras(generated):
                constraint.fill_extras(words[i], generated)
            else:
                constraint.end_if_empty(words[i])
        if self.device.type != "cuda":
            return host  # sampled from before the next step fills the other buffer (CPU steps are synchronous)
        mask = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._turn] = event
        return mask

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if num_rows > self.max_rows:  # a step sampling several positions of a row (speculative verify)
            for event in self._copied:
                if event is not None:
                    event.synchronize()
            self.max_rows, self._host, self._copied = num_rows, [], [None, None]
        if not self._host:
            pinned = self.device.type == "cuda"
            self._host = [torch.empty((self.max_rows, self.words), dtype=torch.int32, pin_memory=pinned)
                          for _ in range(2)]
        self._turn ^= 1
        if self._copied[self._turn] is not None:  # its copy was queued two steps ago: long done
            self._copied[self._turn].synchronize()
        return self._host[self._turn]

    def _batch_matcher(self):
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(self._threads)
        return self._batch
