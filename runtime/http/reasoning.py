"""A thinking model's reasoning split from its answer (server.reasoning_parser), as vLLM and SGLang return it:
the text inside <think>…</think> is `reasoning_content`, the rest `content` (where tool calls are parsed).

qwen3: the model opens the block itself (Qwen3's template puts nothing of it in the prompt; with
enable_thinking=false the template writes an empty block into the prompt and the answer has none): text that does
not begin with <think> is all content.
deepseek_r1 (also for Qwen3's thinking-only models): the template ends the prompt with <think>, so the answer begins inside the block (a <think> the model
writes again is dropped); an answer cut before </think> is all reasoning.

`ReasoningStream` does the same on streamed text: a tag split across deltas is held back until it is whole or
cannot be one.
"""
from __future__ import annotations

from typing import Optional

from llaunch.runtime.config import ReasoningParser

OPEN, CLOSE = "<think>", "</think>"


def _tail_of(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Streamed answer text → (reasoning, content) deltas."""

    def __init__(self, parser: ReasoningParser):
        self.parser = ReasoningParser(parser)
        # "start": not yet known whether the answer opens a block; "reasoning" / "content": where text goes
        self.state = "reasoning" if self.parser == ReasoningParser.deepseek_r1 else "start"
        self.opened = self.state == "reasoning"  # the answer has a block (so a reasoning_content, maybe empty)
        self.leading = True  # deepseek_r1: the answer may repeat the prompt's <think>
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` completes; a possible tag's start is held back."""
        self.held += text
        reasoning, content = [], []
        while self.held:
            if self.state == "start" or (self.state == "reasoning" and self.leading):
                stripped = self.held.lstrip()
                if stripped.startswith(OPEN):
                    self.held = stripped[len(OPEN):]
                    self.state, self.leading, self.opened = "reasoning", False, True
                    continue
                if not stripped or OPEN.startswith(stripped):
                    break  # whitespace or a part of <think> so far
                self.leading = False
                if self.state == "start":
                    self.state = "content"
                continue
            if self.state == "content":
                content.append(self.held)
                self.held = ""
                break
            end = self.held.find(CLOSE)
            if end >= 0:
                reasoning.append(self.held[:end])
                self.held = self.held[end + len(CLOSE):]
                self.state = "content"
                continue
            keep = _tail_of(self.held, CLOSE)
            reasoning.append(self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held at the end of the answer: in the block still, reasoning (a cut answer); else content."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held


def split_reasoning(text: str, parser: ReasoningParser) -> tuple[Optional[str], str]:
    """A whole answer → (reasoning or None when it has no block, content)."""
    stream = ReasoningStream(parser)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2 if stream.opened else None), c1 + c2
