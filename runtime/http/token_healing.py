"""Token healing (LightLLM's token_healing_mode; llama.cpp's "roll back the last token", after
guidance): a prompt that ends mid-word ("The capital of Fra") ends on a token the tokenizer would not
have chosen had the word been whole, and the model, seeing an odd boundary, continues badly. The last
prompt token is backed off, the first generated token must be one whose bytes start with that
token's bytes ("Fra" → "France", "Frank", "Fra", ...), and the returned text leaves those bytes out
(the prompt already has them): the output continues the word as the tokenizer would have cut it.

One token is backed off, and only the first output token is constrained (llama.cpp's ROLLBACK_LAST).
A prompt of one token, or one ending on a special token or on part of a UTF-8 character, is served
as it is."""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Optional

import msgspec

from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import RequestLimits
from llaunch.runtime.ipc.messages import SamplingParams


@dataclass(frozen=True)
class Healing:
    prompt_ids: list[int]  # the prompt less its last token
    prefix: str  # the backed-off token's text: the output starts with it, and it is not returned
    first_ids: list[int]  # the tokens whose bytes start with the backed-off token's: the first token's choices


class TokenHealer:
    """The vocabulary sorted by bytes (built on the first healed request), to find every token that
    starts with given bytes by bisection."""

    def __init__(self, tokenizer: PromptTokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._keys: Optional[list[bytes]] = None
        self._ids: list[int] = []

    def _index(self) -> tuple[list[bytes], list[int]]:
        with self._lock:
            if self._keys is None:
                tok = self.tokenizer
                pairs = sorted((tok.token_bytes(i), i) for i in range(len(tok.hf)) if i not in tok.special_ids)
                self._ids = [i for _, i in pairs]
                self._keys = [b for b, _ in pairs]
            return self._keys, self._ids

    def starting_with(self, prefix: bytes) -> list[int]:
        keys, ids = self._index()
        out, i = [], bisect.bisect_left(keys, prefix)
        while i < len(keys) and keys[i].startswith(prefix):
            out.append(ids[i])
            i += 1
        return sorted(out)

    def heal(self, prompt_ids: list[int]) -> Optional[Healing]:
        """The healed prompt, or None where it cannot be healed (served unchanged)."""
        if len(prompt_ids) < 2 or prompt_ids[-1] in self.tokenizer.special_ids:
            return None
        raw = self.tokenizer.token_bytes(prompt_ids[-1])
        try:
            prefix = raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: its bytes cannot be stripped from text
            return None
        if not prefix:
            return None
        return Healing(prompt_ids[:-1], prefix, self.starting_with(raw))


def healing_of(healer: TokenHealer, prompt_ids: list[int], asked: Optional[bool], limits: RequestLimits,
               samplings: list[SamplingParams], param: str) -> Optional[Healing]:
    """The healing of one prompt, or None: `asked` is the request's switch (None: server.token_healing).
    A request that asks for it where it cannot hold gets a 400; the server's default leaves such
    requests unhealed (a grammar or an allowed-token list constrains the whole text, the backed-off
    prefix included, and prompt logprobs need the prompt's last token)."""
    on = limits.token_healing if asked is None else asked
    if not on:
        return None
    why = ("is not served on a prefill/decode instance" if not limits.token_healing_served else
           "backs off the prompt's last token, whose prompt logprobs are then not available"
           if any(s.prompt_logprobs >= 0 for s in samplings) else
           "cannot combine with structured output or allowed_token_ids (they constrain the backed-off text too)"
           if any(s.constraint or s.allowed_ids for s in samplings) else None)
    if why is None:
        healing = healer.heal(prompt_ids)
        return healing if healing is None else Healing(healing.prompt_ids, healing.prefix,
                                                       [i for i in healing.first_ids if i < limits.vocab_size])
    if asked:
        raise bad_request(f"`{param}` {why}.", param=param)
    return None


def healed(sampling: SamplingParams, healing: Optional[Healing]) -> SamplingParams:
    """The engine request of a healed prompt: its first token restricted, its text left out."""
    if healing is None:
        return sampling
    return msgspec.structs.replace(sampling, heal_ids=healing.first_ids, heal_text=healing.prefix)
