"""Prompt logprobs once per prompt: of a prompt's samples (n, best_of), only the first asks the engine
for them; they do not depend on the sample, and a request that asks computes its whole prompt (no
prompt-cache reuse, chunked by router.prompt_logprob_tokens), so asking once saves n - 1 such prefills.
Each other sample gets the first one's at the end of a collected response. A stream sends each choice's
echo with its own first chunk, so there every sample still asks."""
from __future__ import annotations

import dataclasses

import msgspec

from llaunch.runtime.http.openai_protocol import Choice


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


def share(choices: list[Choice], states: list, fmt) -> None:
    """Give every sample of a prompt the logprobs its first sample got (`states`: ChoiceState per choice;
    `fmt.shared`: what the response shape adds for them, an echo's logprobs say)."""
    first = {}
    for c, state in zip(choices, states):
        if state.prompt_logprobs is not None:
            first.setdefault(c.prompt, state.prompt_logprobs)
    for i, (c, state) in enumerate(zip(choices, states)):
        if state.prompt_logprobs is None and c.prompt in first:
            state.prompt_logprobs = first[c.prompt]
            fmt.shared(i, state)
