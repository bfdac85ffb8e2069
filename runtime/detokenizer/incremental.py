"""Incremental detokenization of one request, with the `tokenizers` library's DecodeStream.

Decoding the whole output after every token is quadratic; decoding a token alone is wrong (byte-level
tokens split multi-byte characters, SentencePiece drops a leading space at the start of a text).
DecodeStream keeps the small window that avoids both, in Rust: 5-7x faster per token than the
Python window it replaced (SmolLM2's tokenizer, 0.8-1.2 µs), the same text. A token whose text is not
complete yet (part of a character, a skipped special token) gives nothing until one that completes it;
at the end, what is still held is decoded against the tokens before it.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from tokenizers.decoders import DecodeStream

from llaunch.runtime.detokenizer.stop_strings import StopStringMatcher

_CONTEXT = 4  # tokens decoded before the held ones at the end: the text they add is what was held


class PrefixStrip:
    """Leaves a known prefix (token healing's backed-off text) out of a text, piece by piece."""

    def __init__(self, prefix: str = ""):
        self.rest = prefix

    def __call__(self, text: str) -> str:
        if not self.rest or not text:
            return text
        if not text.startswith(self.rest[:len(text)]) and self.rest.startswith(" "):
            self.rest = self.rest.lstrip(" ")  # SentencePiece: the output's first space is not decoded
        if not text.startswith(self.rest[:len(text)]):  # not the healed word (a stop token instead): keep it all
            self.rest = ""
            return text
        n = min(len(self.rest), len(text))
        self.rest = self.rest[n:]
        return text[n:]


class IncrementalDecoder:
    """Token ids in, text out; stops at the first stop string (see StopStringMatcher)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 heal_text: str = "", keep_stop: bool = False, min_tokens: int = 0,
                 spaced_tokens: Optional[Mapping[int, str]] = None):
        """`heal_text`: token healing's backed-off text, which the first tokens repeat: left out before
        the stop strings see the text, so they match only what the client gets. `keep_stop`: the stop string that ends the text is part of it.
        `min_tokens`: stop strings end the text only in the tokens after these (vLLM's rule).
        `spaced_tokens` (spaces_between_special_tokens): these tokens' texts (the added tokens kept in
        the text) stand apart from the text around them by a space, as a slow tokenizer's decode joins
        its runs of ordinary tokens and its added tokens."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer of a fast transformers tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._settled = 0  # the text of ids[:settled] has been handed to the stop matcher
        self.matcher = StopStringMatcher(stop, keep_stop)
        self.strip = PrefixStrip(heal_text)
        self.min_tokens = min_tokens
        self.spaced = spaced_tokens
        self._spoken = False  # some text went out (a space then separates the next added token)
        self._after_spaced = False  # the last token was a spaced one: the next text starts with a space

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped is not None

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that can be sent now (may be empty)."""
        self.ids.append(token_id)
        if self.spaced is not None and token_id in self.spaced:
            piece = (" " if self._spoken else "") + self.spaced[token_id]
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)  # the next run starts anew
            self._after_spaced = True
        else:
            piece = self._stream.step(self._backend, token_id)
            if piece is None:
                return ""
            if self._after_spaced and piece:
                piece, self._after_spaced = " " + piece, False
        self._spoken = self._spoken or bool(piece)
        self._settled = len(self.ids)
        return self.matcher.feed(self.strip(piece), armed=len(self.ids) > self.min_tokens)

    def flush(self) -> str:
        """The request is over: release incomplete characters and held-back stop prefixes."""
        text = self.matcher.feed(self.strip(self._held_text()), armed=len(self.ids) > self.min_tokens)
        return text if self.stopped else text + self.matcher.flush()

    def _held_text(self) -> str:
        if self._settled == len(self.ids):
            return ""
        start = max(0, self._settled - _CONTEXT)
        before = self._decode(self.ids[start:self._settled])
        return self._decode(self.ids[start:])[len(before):]

    def _decode(self, ids: list[int]) -> str:
        # No clean-up: it rewrites spaces across the window edge, so pieces would not concatenate.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
