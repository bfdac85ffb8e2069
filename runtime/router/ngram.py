"""N-gram proposals for speculative decoding (spec=ngram): the tokens that followed the latest earlier occurrence of the
longest suffix of a request's tokens; where they run into the suffix itself (text that repeats with a period shorter
than the proposal: a list, a table, a loop), the proposal goes on repeating that period, as LZ77's overlapping copy
does (scripts/spec_acceptance.py at ngram_max = 3, output tokens a step at k = 4 / 8: 3.16 / 3.52 cut at the present,
3.92 / 5.78 repeating on the 18-block SmolLM2 cut the spec benchmark serves, which falls into loops; 3.74 / 5.25 and
3.78 / 5.60 on the whole model). The router looks up each speculating row every step (twice for a chained verify), so
the lookup is what its step costs per row: a request's tokens are kept as a growing int64 array (TokenHistory,
appended as the output grows, not converted from the prompt + output lists each step) and a suffix is matched
backwards from its last token: the positions holding it and the token before (two vectorized comparisons over the
history), then each candidate's match length over up to ngram_max tokens, the latest 16 one by one (a loop's latest
candidate matches them all and ends the search) and the rest in one array. On an 8k-token history that took 259 µs a
lookup as a list → array conversion and a sliding window comparison; with a pass over the history per suffix length,
longest first, 7.4 / 14 / 25 µs at ngram_max = 3 / 8 / 16 (a copy; 40 µs at 8 on a loop of 5 tokens); now 9 µs at any
of them (20 on the loop, 3.4 without a match)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

FEW = 16  # the latest candidates compared one by one (a Python loop), before the rest in one array


def propose(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int, repeat: bool = True) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (ngram_max down to ngram_min tokens long); [] when none occurred. Fewer than `k` follow it when it lies within
    k tokens of the end: `repeat` continues them with the period that occurrence implies (x[t] = x[t - d], d its
    distance back), else the proposal stops at the end."""
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)
    n_tok = len(arr)
    if k <= 0 or n_tok < ngram_min + 1:
        return []
    # every earlier position holding the last token (a match's end; the suffix itself excluded), kept where the token
    # before holds the one before the last; then each one's match length over up to ngram_max tokens back, at once
    ends = np.flatnonzero(arr[:n_tok - 1] == arr[n_tok - 1])
    if ngram_max > 1 and ends.size:  # (a history of one token has no earlier position: n_tok >= 2 here)
        later = ends[ends >= 1]
        pair = later[arr[later - 1] == arr[n_tok - 2]]
        if pair.size or ngram_min > 1:
            ends = pair
    if not ends.size:
        return []
    span = min(ngram_max, n_tok - 1)
    # the latest FEW one by one (a loop's latest match holds all `span` tokens: the answer), then the earlier ones
    # at once, which win only by a longer match
    suffix = arr[n_tok - span:].tolist()[::-1]
    best, start = 0, -1
    for end in ends[:-FEW - 1:-1].tolist():
        window = arr[max(end - span + 1, 0):end + 1].tolist()[::-1]
        length = next((i for i, (a, b) in enumerate(zip(window, suffix)) if a != b), len(window))
        if length > best:
            best, start = length, end + 1
            if length == span:
                break
    if best < span and ends.size > FEW:
        earlier = ends[:-FEW]
        back = np.arange(span)
        at = earlier[:, None] - back
        same = (arr[np.maximum(at, 0)] == arr[n_tok - 1 - back]) & (at >= 0)
        lengths = np.where(same.all(axis=1), span, same.argmin(axis=1))
        if int(lengths.max()) > best:
            best = int(lengths.max())
            start = int(earlier[np.flatnonzero(lengths == best)[-1]]) + 1
    if best < ngram_min:
        return []
    proposal = arr[start:start + k].tolist()
    period = n_tok - start
    while repeat and len(proposal) < k:
        proposal.append(proposal[len(proposal) - period])
    return proposal


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
