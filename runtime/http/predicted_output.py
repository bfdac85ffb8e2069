"""OpenAI's Predicted Outputs: a chat completion's `prediction` ({"type": "content", "content": text or text
parts}) is text the answer is expected to repeat (a file to edit, a document to revise). Its tokens travel with
the request (AddRequest.prediction_ids) and spec=ngram's lookup searches them after the prompt, so a proposal can
copy from the prediction where the prompt does not hold the text. Only a speed hint: the output is what decoding
without it gives (greedy: the same tokens); without spec=ngram it has no effect. usage.completion_tokens_details
counts the prediction's tokens the answer holds (accepted) and the rest (rejected), as OpenAI defines them."""
from __future__ import annotations

import asyncio
import difflib
from typing import Any, Sequence

from llaunch.runtime.web.errors import bad_request


def prediction_text(prediction: Any) -> str:
    """The predicted text of a `prediction` field; a 400 for any other shape."""
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise bad_request("`prediction` must be {\"type\": \"content\", \"content\": ...} (OpenAI's predicted output).",
                          param="prediction")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request("`prediction.content` must be a string or a list of {\"type\": \"text\", \"text\": ...} parts.",
                      param="prediction.content")


def prediction_ids(prediction: Any, tokenizer, max_model_len: int) -> list[int]:
    """The tokens of a chat request's `prediction` ([] without one); longer than the model's context, a 400: no
    answer could repeat it, and the lookup would search it every step."""
    if prediction is None:
        return []
    ids = tokenizer.encode_plain(prediction_text(prediction))
    if len(ids) > max_model_len:
        raise bad_request(f"`prediction` is {len(ids)} tokens, more than the model's context of {max_model_len}.",
                          param="prediction")
    return ids


def matched_tokens(prediction: Sequence[int], output: Sequence[int]) -> int:
    """How many of the prediction's tokens appear in the output, in order (the longest matching runs, as difflib
    aligns them): OpenAI's accepted prediction tokens; the rest of the prediction is rejected."""
    matcher = difflib.SequenceMatcher(None, list(prediction), list(output), autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


async def prediction_usage(prediction: Sequence[int], outputs: list[Sequence[int]]) -> dict:
    """usage.completion_tokens_details of a request with a prediction, summed over its choices; in a thread (an
    alignment of two 8k-token texts of few distinct tokens takes ~0.4 s)."""
    accepted = sum(await asyncio.gather(*(asyncio.to_thread(matched_tokens, prediction, out) for out in outputs)))
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": len(prediction) * len(outputs) - accepted}
