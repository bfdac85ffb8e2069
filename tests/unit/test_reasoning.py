"""server.reasoning_parser on answers as they stream: every way of cutting an answer into deltas gives the whole
answer's split, and each parser splits as vLLM's parser of that name does."""
from __future__ import annotations

import itertools

import pytest

from llaunch.runtime.config import ReasoningParser
from llaunch.runtime.http.reasoning import ReasoningStream, split_reasoning

QWEN3, R1 = ReasoningParser.qwen3, ReasoningParser.deepseek_r1

CASES = [  # (parser, answer, reasoning, content)
    (QWEN3, "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "\n\nIt is 4."),
    (QWEN3, "It is 4.", None, "It is 4."),  # enable_thinking=false: the block is in the prompt
    (QWEN3, "\n<think>a < b</think>c", "a < b", "c"),  # leading whitespace; a '<' that is no tag
    (QWEN3, "<think>cut by max_tokens", "cut by max_tokens", ""),
    (QWEN3, "<think></think>", "", ""),
    (QWEN3, "Answer <think>x</think>", None, "Answer <think>x</think>"),  # a block later is content
    (QWEN3, "<thin", None, "<thin"),  # the start of a tag that never finishes
    (R1, "Okay, 2+2.</think>\n\n4", "Okay, 2+2.", "\n\n4"),
    (R1, "<think>\nOkay.</think>4", "\nOkay.", "4"),  # the model repeats the prompt's <think>
    (R1, "still thinking </thi", "still thinking </thi", ""),  # cut inside the block: all reasoning
    (R1, "</think>", "", ""),
]


@pytest.mark.parametrize("parser,answer,reasoning,content", CASES)
def test_whole_answer_splits(parser, answer, reasoning, content):
    assert split_reasoning(answer, parser) == (reasoning, content)


@pytest.mark.parametrize("parser,answer,reasoning,content", CASES)
def test_every_cut_of_the_stream_gives_the_same_split(parser, answer, reasoning, content):
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, len(answer)), k) for k in (1, 2)):
        stream = ReasoningStream(parser)
        got_r, got_c = "", ""
        for a, b in zip((0, *cuts), (*cuts, len(answer))):
            r, c = stream.feed(answer[a:b])
            got_r, got_c = got_r + r, got_c + c
        r, c = stream.finish()
        assert (got_r + r, got_c + c) == (reasoning or "", content), cuts


def test_a_split_tag_is_held_until_it_is_whole():
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>ab</th") == ("ab", "")
    assert stream.feed("ink>c") == ("", "c")
