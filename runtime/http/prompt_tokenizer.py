"""The frontend's view of the tokenizer: prompts to ids (with the checkpoint's chat template) and ids
to the token strings and bytes that logprobs report. Generated text comes from the detokenizer."""
from __future__ import annotations

import re
import threading
from functools import lru_cache
from typing import Optional

from llaunch.runtime.http.tool_calls import template_format

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2 byte-level BPE maps every byte to a printable character; invert that map.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(hf_tokenizer) -> bool:
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


class PromptTokenizer:
    def __init__(self, hf_tokenizer, vocab_size: Optional[int] = None, tool_call_format: Optional[str] = None):
        """`tool_call_format`: server.tool_call_format (None: the one the chat template speaks)."""
        self.hf = hf_tokenizer
        # The model's vocabulary may be padded beyond the tokenizer's: ids up to it are valid input.
        self.vocab_size = vocab_size or len(hf_tokenizer)
        self.special_ids = frozenset(hf_tokenizer.all_special_ids)
        self._byte_level = _is_byte_level(hf_tokenizer)
        self._text_cache: dict[int, str] = {}
        self._bytes_cache: dict[int, bytes] = {}
        # requests tokenize on worker threads; transformers' encode may reset the backend's truncation
        # and padding (a borrow of the Rust tokenizer), which is not safe from two threads at once
        self._lock = threading.Lock()
        # the longest token, in characters: a piece's length bounds the text it decodes to (byte-level
        # pieces have one character per byte, SentencePiece pieces one per character)
        self.max_token_chars = max((len(piece) for piece in hf_tokenizer.get_vocab()), default=1)
        template = getattr(hf_tokenizer, "chat_template", None)
        self.template_has_tools = isinstance(template, str) and "tools" in template
        self.tool_format = template_format(template if isinstance(template, str) else None, tool_call_format)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=True))

    def encode_plain(self, text: str) -> list[int]:
        """The text's own tokens, without BOS or other special tokens."""
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=False))

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """A text pair as the tokenizer's pair template joins it (vLLM's cross-encoder prompts)."""
        with self._lock:
            return list(self.hf(text, text_pair=pair, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict], tools: Optional[list[dict]] = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    documents: Optional[list[dict]] = None, chat_template: Optional[str] = None,
                    template_kwargs: Optional[dict] = None, add_special_tokens: bool = False) -> list[int]:
        """`template_kwargs`: variables for the template (chat_template_kwargs); `add_special_tokens`:
        BOS and the like on top of what the template writes (vLLM's chat default: no)."""
        text = self.hf.apply_chat_template(messages, tools=tools, documents=documents, chat_template=chat_template,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tokenize=False,
                                           **(template_kwargs or {}))
        return self.encode(text) if add_special_tokens else self.encode_plain(text)

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self.hf.decode(ids)

    def token_text(self, token_id: int) -> str:
        text = self._text_cache.get(token_id)
        if text is None:
            text = self._text_cache[token_id] = self.hf.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes: a token may hold part of a UTF-8 character that decodes to U+FFFD."""
        raw = self._bytes_cache.get(token_id)
        if raw is None:
            raw = self._bytes_cache[token_id] = self._raw_bytes(token_id)
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None or token_id in self.special_ids:
            return self.token_text(token_id).encode("utf-8")
        byte_fallback = _BYTE_TOKEN.match(piece)
        if byte_fallback:
            return bytes([int(byte_fallback.group(1), 16)])
        if self._byte_level:
            decoder = _byte_decoder()
            if all(ch in decoder for ch in piece):
                return bytes(decoder[ch] for ch in piece)
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece word boundary
