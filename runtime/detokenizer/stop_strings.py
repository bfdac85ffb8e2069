"""Stop strings over a stream of text: release text that can no longer become part of a stop string,
cut the output at the first stop string to complete; the stop string itself is not returned unless
asked for (`keep`: vLLM's include_stop_str_in_output, and TGI's generated_text)."""
from __future__ import annotations

from typing import Sequence


def _failure(s: str) -> list[int]:
    """KMP: fail[i] is the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopStringMatcher:
    """Feed text pieces; get back the text that is safe to send.

    Text whose tail could still grow into a stop string is held back until the next piece settles
    it. A stop string is recognised as soon as it is complete; when several complete in one piece,
    the one that ends first wins (ties: the longer one), so the result does not depend on how the
    text was split into pieces.

    Each stop string follows the text with a KMP automaton whose state is the longest prefix of it
    the text ends with: a piece costs O(its length × stop strings), however long the stop strings.
    """

    def __init__(self, stop: Sequence[str], keep: bool = False):
        self.keep = keep  # the text released at a stop ends with the stop string
        self.stop = [s for s in stop if s]  # an empty stop string would end every request at once
        self._fail = [_failure(s) for s in self.stop]
        self._state = [0] * len(self.stop)
        self.held = ""
        self.stopped: str | None = None  # the stop string that ended the text

    def feed(self, piece: str, armed: bool = True) -> str:
        """Append `piece`; returns the newly released text (after a stop: the text before it). Not
        `armed` (min_tokens not out yet): a stop string that completes does not stop, nothing is held."""
        if self.stopped is not None:
            return ""
        text = self.held + piece
        base = len(self.held)
        for offset, ch in enumerate(piece):
            done = None  # the longest stop string completing at this character
            for i, s in enumerate(self.stop):
                k = self._state[i]
                while k and (k == len(s) or s[k] != ch):
                    k = self._fail[i][k - 1]
                if s[k] == ch:
                    k += 1
                self._state[i] = k
                if k == len(s) and (done is None or len(s) > len(done)):
                    done = s
            if done is not None and armed:
                self.stopped, self.held = done, ""
                # (a stop string that began in text released before it was armed: the cut is at the start)
                return text[:max(0, base + offset + 1 - (0 if self.keep else len(done)))]
        keep = max(self._state, default=0) if armed else 0
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The text is over: release what was held back (it can no longer complete a stop string)."""
        text, self.held = self.held, ""
        return text
