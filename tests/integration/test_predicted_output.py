"""OpenAI's predicted outputs through the whole process graph on SmolLM2's real weights under spec=ngram: a chat
request whose `prediction` holds the answer gets the same greedy text as without it, and the n-gram proposals copy
from the prediction (many more accepted tokens, though the prompt does not hold the text); a wrong prediction
changes nothing but the proposals; usage counts the prediction's accepted and rejected tokens. The official client
sends the field."""
from __future__ import annotations

import time

import pytest
from openai import BadRequestError, OpenAI

from integration.conftest import start_server
from integration.server import metric_samples

MAX_NEW = 40
# prompts whose answers are not in them: only a prediction gives the lookup their text
QUESTIONS = ["Write two sentences about the sea.", "Name three fruits and say what colour each is."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start_server(tmp_path_factory, "spec-prediction", ["spec=ngram", "spec.num_tokens=4"]) as s:
        yield s


def settled_accepted(server) -> float:
    """spec_decode_num_accepted_tokens_total once the router's reports (every 0.25 s) have caught up."""
    last, seen = None, 0.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.6)
        seen = sum(metric_samples(server.url, "spec_decode_num_accepted_tokens_total").values())
        if seen == last:
            return seen
        last = seen
    return seen


def ask(client: OpenAI, question: str, prediction: str | None):
    """(the answer, its usage)"""
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction is not None else {}
    out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                         max_tokens=MAX_NEW, temperature=0.0, **extra)
    return out.choices[0].message.content, out.usage


def test_a_prediction_is_copied_from_and_changes_no_token(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for question in QUESTIONS:
        before = settled_accepted(server)
        plain, usage = ask(client, question, None)
        assert usage.completion_tokens_details is None  # no prediction, nothing to count
        unpredicted = settled_accepted(server) - before
        predicted_text, usage = ask(client, question, plain)
        predicted = settled_accepted(server) - before - unpredicted
        assert predicted_text == plain
        # OpenAI's counts: the prediction's tokens the answer holds (here all, as the text retokenizes), the rest
        details = usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= usage.completion_tokens - 2, (usage, details)
        assert details.rejected_prediction_tokens <= 2, details
        # nearly every token of the answer came from a kept proposal (some verify steps keep all k and add one)
        assert predicted >= unpredicted + MAX_NEW / 2, (question, unpredicted, predicted)
        # parts of text form, and a prediction that is wrong: the same text
        parts = [{"type": "text", "text": "The ocean is"}, {"type": "text", "text": " nothing like this at all."}]
        out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                             max_tokens=MAX_NEW, temperature=0.0,
                                             prediction={"type": "content", "content": parts})
        assert out.choices[0].message.content == plain
        wrong = out.usage.completion_tokens_details
        assert wrong.rejected_prediction_tokens > wrong.accepted_prediction_tokens, wrong
        # streamed: the last chunk's usage counts them too
        stream = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                                max_tokens=MAX_NEW, temperature=0.0, stream=True,
                                                stream_options={"include_usage": True},
                                                prediction={"type": "content", "content": plain})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
        assert chunks[-1].usage.completion_tokens_details == details


def test_a_prediction_of_another_shape_is_a_400_that_names_it(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for prediction, param in [({"type": "image", "content": "x"}, "prediction"),
                              ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                               "prediction.content"),
                              ({"type": "content", "content": "word " * 9000}, "prediction")]:
        with pytest.raises(BadRequestError) as err:
            client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, prediction=prediction)
        assert err.value.body["param"] == param, err.value.body
