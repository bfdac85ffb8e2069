"""Stop strings over a stream of text: release text that can no longer become part of a stop string,
cut the output at the first stop string to complete, never return the stop string itself."""
from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    """Feed text pieces; get back the text that is safe to send.

    Text whose tail could still grow into a stop string is held back until the next piece settles
    it. A stop string is recognised as soon as it is complete; when several complete in one piece,
    the one that ends first wins (ties: the longer one), so the result does not depend on how the
    text was split into pieces.
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]  # an empty stop string would end every request at once
        self.held = ""
        self.stopped: str | None = None  # the stop string that ended the text

    def feed(self, piece: str) -> str:
        """Append `piece`; returns the newly released text (after a stop: the text before it)."""
        if self.stopped is not None:
            return ""
        text = self.held + piece
        cut = self._first_complete(text)
        if cut is not None:
            self.held = ""
            return text[:cut]
        keep = self._longest_open_prefix(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The text is over: release what was held back (it can no longer complete a stop string)."""
        text, self.held = self.held, ""
        return text

    def _first_complete(self, text: str) -> int | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            start = text.find(s)
            if start >= 0:
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            return None
        self.stopped = best[2]
        return best[1]

    def _longest_open_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
