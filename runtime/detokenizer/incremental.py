"""Incremental detokenization of one request (vLLM/SGLang style).

Decoding the whole output after every token is quadratic; decoding a token alone is wrong (byte-level
tokens split multi-byte characters, SentencePiece drops a leading space at the start of a text). So
each step decodes a small window `ids[prefix_offset:]` and emits only what it adds to the already
emitted `ids[prefix_offset:read_offset]`; text ending in U+FFFD (an incomplete character) waits for
the next token.
"""
from __future__ import annotations

from typing import Any, Sequence

from llaunch.runtime.detokenizer.stop_strings import StopStringMatcher

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDecoder:
    """Token ids in, text out; stops at the first stop string (see StopStringMatcher)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window: text of ids[:prefix_offset] is settled
        self.read_offset = 0  # text of ids[:read_offset] has been handed to the stop matcher
        self.matcher = StopStringMatcher(stop)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped is not None

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that can be sent now (may be empty)."""
        self.ids.append(token_id)
        piece = self._new_text(final=False)
        return self.matcher.feed(piece)

    def flush(self) -> str:
        """The request is over: release incomplete characters and held-back stop prefixes."""
        piece = self._new_text(final=True)
        text = self.matcher.feed(piece)
        return text if self.stopped else text + self.matcher.flush()

    def _decode(self, ids: list[int]) -> str:
        # No clean-up: it rewrites spaces across the window edge, so windows would not concatenate.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _new_text(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. a skipped special token: nothing visible yet
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # a multi-byte character continues in the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]
