"""Diverse mode (router.diverse_mode, LightLLM's diverse_mode): the samples of one prompt (OpenAI's n
and best_of, LightLLM's best_of) prefill it once. The first request of a prompt computes it; a waiting
request with the same prompt is held until that prompt's KV is written (its first token is back),
which then goes into the prompt cache at once (PromptCache.share_prompt) instead of when the request
ends; the held ones borrow it there and compute only their last prompt token. Samples stay apart by
their seeds (the request's seed + i, or one drawn for each)."""
from __future__ import annotations

from llaunch.runtime.router.prompt_cache import NoPromptCache
from llaunch.runtime.router.request import Request


class PromptSharing:
    def __init__(self, on: bool, cache: NoPromptCache):
        self.on = on
        self.cache = cache
        self._computing: dict[tuple[int, ...], Request] = {}  # prompt → the request computing it

    def waits(self, req: Request) -> bool:
        """Is the request's prompt being computed by another (hold it: it will borrow the KV)? A request
        reading every prompt position (prompt logprobs, mean pooling) computes its prompt itself (those outputs
        are not cached), so it never waits."""
        return (self.on and bool(self._computing) and not req.reads_whole_prompt
                and tuple(req.prompt_ids) in self._computing)

    def admitted(self, req: Request) -> None:
        if self.on and req.num_cached < req.prompt_len - 1 and not req.reads_whole_prompt:  # it computes it
            self._computing[tuple(req.prompt_ids)] = req

    def computed(self, req: Request) -> None:
        """The request's first token is back: its prompt's KV is written; share it."""
        if self.on and self._computing.get(tuple(req.prompt_ids)) is req:
            del self._computing[tuple(req.prompt_ids)]
            self.cache.share_prompt(req)

    def ended(self, req: Request) -> None:
        """The request ended (perhaps before its prompt was computed): the others need not wait."""
        if self.on and self._computing.get(tuple(req.prompt_ids)) is req:
            del self._computing[tuple(req.prompt_ids)]

    def clear(self) -> None:
        self._computing.clear()
