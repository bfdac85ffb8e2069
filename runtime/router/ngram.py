"""N-gram proposals for speculative decoding (spec=ngram): the tokens that followed the latest earlier occurrence of
the longest suffix of a request's tokens; where they run into the suffix itself (text that repeats with a period
shorter than the proposal: a list, a table, a loop), the proposal goes on repeating that period, as LZ77's
overlapping copy does (on SmolLM2's copies, scripts/spec_acceptance.py: 3.16 output tokens a step at k = 4 cut at
the present, 3.92 repeating; 3.52 / 5.78 at k = 8). The router looks up each speculating row every step (twice for a chained
verify), so the lookup is what its step costs per row: a request's tokens are kept as a growing int64 array
(TokenHistory, appended as the output grows, not converted from the prompt + output lists each step) and a suffix
is matched token by token over candidate positions (one vectorized comparison over the history, then a few over
the candidates). On an 8k-token history that took 259 µs a lookup as a list → array conversion and a sliding
window comparison."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def propose(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int, repeat: bool = True) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (ngram_max down to ngram_min tokens long); [] when none occurred. Fewer than `k` follow it when it lies within
    k tokens of the end: `repeat` continues them with the period that occurrence implies (x[t] = x[t - d], d its
    distance back), else the proposal stops at the end."""
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
    n_tok = len(arr)
    if k <= 0 or n_tok < ngram_min + 1:
        return []
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        suffix = arr[n_tok - n:]
        # windows of arr[:-1] starting at 0 .. n_tok-n-1 (the suffix itself excluded): first tokens, then the rest
        hits = np.flatnonzero(arr[:n_tok - n] == suffix[0])
        for i in range(1, n):
            if not hits.size:
                break
            hits = hits[arr[hits + i] == suffix[i]]
        if hits.size:
            start = int(hits[-1]) + n
            proposal = arr[start:start + k].tolist()
            period = n_tok - start
            while repeat and len(proposal) < k:
                proposal.append(proposal[len(proposal) - period])
            return proposal
    return []


class TokenHistory:
    """A request's prompt + output tokens as an int64 array, grown as the output grows."""

    def __init__(self) -> None:
        self._buf = np.empty(1024, dtype=np.int64)
        self._n = 0

    def sync(self, prompt: list[int], output: list[int]) -> np.ndarray:
        """The tokens prompt + output (a view, valid until the next sync): appends what is new since the last sync
        (a request's tokens only grow); rebuilt where they are fewer or the last one held differs."""
        total = len(prompt) + len(output)
        n = self._n
        if n > total or (n and self._buf[n - 1] != (prompt[n - 1] if n <= len(prompt) else output[n - 1 - len(prompt)])):
            n = 0
        if n < total:
            if total > len(self._buf):
                grown = np.empty(max(total, 2 * len(self._buf)), dtype=np.int64)
                grown[:n] = self._buf[:n]
                self._buf = grown
            if n < len(prompt):
                self._buf[n:len(prompt)] = prompt[n:]
                n = len(prompt)
            self._buf[n:total] = output[n - len(prompt):]
        self._n = total
        return self._buf[:total]
