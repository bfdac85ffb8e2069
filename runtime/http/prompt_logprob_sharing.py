"""Prompt logprobs once per prompt: of a prompt's samples (n, best_of), only the first asks the engine
for them; they do not depend on the sample, and a request that asks computes its whole prompt (no
prompt-cache reuse, chunked by router.prompt_logprob_tokens), so asking once saves n - 1 such prefills.
`SharedPromptLogprobs` hands each other sample the first one's with its own first delta, holding that
sample's deltas until they are there (so a streamed echo still leads each choice with its logprobs)."""
from __future__ import annotations

import dataclasses

import msgspec

from llaunch.runtime.http.openai_protocol import Choice
from llaunch.runtime.ipc.messages import TextDelta


def ask_once(choices: list[Choice]) -> list[Choice]:
    """The choices, the prompt logprobs asked by the first sample of each prompt only."""
    asked: set[int] = set()
    out = []
    for c in choices:
        if c.sampling.prompt_logprobs >= 0:
            if c.prompt in asked:
                c = dataclasses.replace(c, sampling=msgspec.structs.replace(c.sampling, prompt_logprobs=-1))
            asked.add(c.prompt)
        out.append(c)
    return out


class SharedPromptLogprobs:
    """Between the engine's deltas (by choice index) and the response: `feed` each, send what it returns."""

    def __init__(self, choices: list[Choice], asked: list[Choice]):
        self.prompt_of = [c.prompt for c in choices]
        self.waiting = {i for i, (c, a) in enumerate(zip(choices, asked))
                        if c.sampling.prompt_logprobs >= 0 > a.sampling.prompt_logprobs}
        self.known: dict = {}  # prompt → its logprobs, once its first sample brought them
        self.held: dict[int, list[TextDelta]] = {}  # a waiting choice's deltas, in order

    def feed(self, index: int, delta: TextDelta) -> list[tuple[int, TextDelta]]:
        prompt = self.prompt_of[index]
        if index in self.waiting:
            if prompt not in self.known:
                self.held.setdefault(index, []).append(delta)
                return []
            self.waiting.discard(index)
            return [(index, msgspec.structs.replace(delta, prompt_logprobs=self.known[prompt]))]
        out = [(index, delta)]
        if delta.prompt_logprobs is not None and prompt not in self.known:
            self.known[prompt] = delta.prompt_logprobs
            for other in [i for i in self.held if self.prompt_of[i] == prompt]:
                first, *rest = self.held.pop(other)
                self.waiting.discard(other)
                out += [(other, msgspec.structs.replace(first, prompt_logprobs=delta.prompt_logprobs))]
                out += [(other, d) for d in rest]
        return out

    def drain(self) -> list[tuple[int, TextDelta]]:
        """Deltas still held when the engine is done (their prompt's logprobs never came: not expected)."""
        out = [(i, d) for i, held in self.held.items() for d in held]
        self.held = {}
        return out


async def relayed(group, relay: SharedPromptLogprobs):
    """(choice index, delta) of a RequestGroup, through `relay`, then what it still holds."""
    async for index, delta in group:
        for pair in relay.feed(index, delta):
            yield pair
    for pair in relay.drain():
        yield pair
