"""N-gram proposals (runtime/router/ngram.py) against a plain loop over every earlier position (a continuation that
reaches the present read from the text as the proposal grows it), and a request's token history kept as an array
(appended as the output grows, rebuilt when it is not an extension)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from llaunch.runtime.router.ngram import TokenHistory, propose


def latest_occurrence(tokens: list[int], k: int, ngram_min: int, ngram_max: int, repeat: bool) -> list[int]:
    """The oracle: for the longest suffix first, every earlier window from the latest back; its continuation read
    token by token from the text as it grows (each proposed token is appended before the next is read), or, without
    `repeat`, from the tokens alone."""
    n_tok = len(tokens)
    if k <= 0 or n_tok < ngram_min + 1:
        return []
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[n_tok - n:]:
                text = list(tokens)
                while len(text) - n_tok < k and (repeat or start + n + len(text) - n_tok < n_tok):
                    text.append(text[start + n + len(text) - n_tok])
                return text[n_tok:]
    return []


def history(rng: random.Random, vocab: int) -> list[int]:
    """Random tokens, or a short pattern repeating with 5% noise (many earlier candidates, of every match length)."""
    n = rng.randrange(0, 200)
    if rng.random() < 0.5:
        return [rng.randrange(vocab) for _ in range(n)]
    pattern = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
    return [pattern[i % len(pattern)] if rng.random() > 0.05 else rng.randrange(vocab) for i in range(n)]


@pytest.mark.parametrize("repeat", [True, False])
@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_proposals_match_the_latest_earlier_occurrence(vocab, repeat):
    rng = random.Random(vocab)
    for _ in range(400):
        tokens = history(rng, vocab)
        k, ngram_min = rng.randrange(0, 9), rng.randrange(1, 5)
        ngram_max = ngram_min + rng.randrange(0, 17)
        want = latest_occurrence(tokens, k, ngram_min, ngram_max, repeat)
        assert propose(tokens, k, ngram_min, ngram_max, repeat) == want, (tokens, k, ngram_min, ngram_max)
        assert propose(np.asarray(tokens, dtype=np.int64), k, ngram_min, ngram_max, repeat) == want


def test_a_proposal_that_reaches_the_present_repeats_its_period():
    """"a b c" last seen 3 tokens back: the text repeats every 3 tokens, and the proposal goes on doing so."""
    tokens = [9, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert propose(tokens, 7, 1, 3) == [1, 2, 3, 1, 2, 3, 1]
    assert propose(tokens, 7, 1, 3, repeat=False) == [1, 2, 3]
    assert propose([4, 4], 5, 1, 3) == [4, 4, 4, 4, 4]  # a token repeating: period 1


def test_an_earlier_longer_match_beats_many_later_shorter_ones():
    """More than 16 later candidates match "3 4" only; the earliest matches all 5 tokens and wins."""
    assert propose([0, 1, 2, 3, 4, 99] + [3, 4, 50] * 20 + [0, 1, 2, 3, 4], 1, 1, 8) == [99]
    assert propose([1, 2, 8, 2, 3, 9, 2, 3], 4, 3, 5) == []  # "2 3" seen, but no 3-token suffix: below ngram_min


def test_the_history_grows_with_the_output_and_rebuilds_otherwise():
    history = TokenHistory()
    prompt = list(range(1500))  # past the first buffer
    output: list[int] = []
    assert history.sync(prompt, output).tolist() == prompt
    for token in (7, 8, 9):
        output.append(token)
        assert history.sync(prompt, output).tolist() == prompt + output
    assert history.sync(prompt, output[:2]).tolist() == prompt + [7, 8]  # shorter: rebuilt
    assert history.sync(prompt, [7, 5, 6]).tolist() == prompt + [7, 5, 6]  # its last token differs: rebuilt
    assert history.sync([3, 4], []).tolist() == [3, 4]  # another request's
