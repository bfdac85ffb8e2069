"""N-gram proposals (runtime/router/ngram.py) against a plain loop over every earlier position, and a request's token
history kept as an array (appended as the output grows, rebuilt when it is not an extension)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from llaunch.runtime.router.ngram import TokenHistory, propose


def latest_occurrence(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The oracle: for the longest suffix first, every earlier window from the latest back."""
    n_tok = len(tokens)
    if k <= 0 or n_tok < ngram_min + 1:
        return []
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[n_tok - n:]:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_proposals_match_the_latest_earlier_occurrence(vocab):
    rng = random.Random(vocab)
    for _ in range(400):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        k, ngram_min = rng.randrange(0, 6), rng.randrange(1, 3)
        ngram_max = ngram_min + rng.randrange(0, 3)
        want = latest_occurrence(tokens, k, ngram_min, ngram_max)
        assert propose(tokens, k, ngram_min, ngram_max) == want, (tokens, k, ngram_min, ngram_max)
        assert propose(np.asarray(tokens, dtype=np.int64), k, ngram_min, ngram_max) == want


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
