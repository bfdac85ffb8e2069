"""OpenAI's predicted outputs at the HTTP layer: the shapes a client may send, and the usage counts of accepted and
rejected prediction tokens (the prediction's tokens the answer holds in order, the rest)."""
import asyncio

import pytest

from llaunch.runtime.http.predicted_output import matched_tokens, prediction_text, prediction_usage
from llaunch.runtime.web.errors import ApiError


def test_text_or_text_parts_and_nothing_else():
    assert prediction_text({"type": "content", "content": "def f():\n"}) == "def f():\n"
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
    assert prediction_text({"type": "content", "content": parts}) == "a b"
    for bad in ["text", {"content": "x"}, {"type": "content", "content": 3},
                {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]:
        with pytest.raises(ApiError):
            prediction_text(bad)


def test_accepted_tokens_are_the_predictions_tokens_the_answer_holds_in_order():
    assert matched_tokens([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6]) == 4  # 3 was replaced
    assert matched_tokens([1, 2, 3], [3, 2, 1]) == 1  # order counts: one of them lines up
    assert matched_tokens([7, 7, 7], []) == 0
    usage = asyncio.run(prediction_usage([1, 2, 3, 4], [[1, 2, 3, 4], [4, 3]]))  # two choices, each against it
    assert usage == {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 3}
