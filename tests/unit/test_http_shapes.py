"""The shapes the frontend answers with, over real HTTP (unit/scripted_frontend.py): vLLM's model card,
/tokenize and /detokenize, and every OpenAI body checked by the openai package's own types."""
from __future__ import annotations

import json

import openai
import pytest

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer

from unit.http_support import MODEL, smollm2_tokenizer
from unit.scripted_frontend import LIMITS


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def server(scripted_server):
    return scripted_server


def test_model_card_tokenize_and_detokenize(server, tok):
    card = server.openai().models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len == LIMITS.max_model_len
    with pytest.raises(openai.NotFoundError):
        server.openai().models.retrieve("gpt-9")

    def post(path: str, body: dict):
        status, _, data = server.raw("POST", path, json.dumps(body).encode())
        return status, json.loads(data)

    text = "Hello there, tokenizer."
    status, out = post("/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert status == 200 and out["tokens"] == tok.hf.encode(text) and out["count"] == len(out["tokens"])
    assert "".join(out["token_strs"]) == tok.hf.decode(out["tokens"]) and out["max_model_len"] == LIMITS.max_model_len
    messages = [{"role": "user", "content": text}]
    status, out = post("/tokenize", {"messages": messages})
    want = tok.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert status == 200 and out["tokens"] == tok.hf.encode(want, add_special_tokens=False)
    assert out["token_strs"] is None
    assert post("/detokenize", {"model": MODEL, "tokens": out["tokens"]}) == (200, {"prompt": want})
    for path, body, param in [("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/tokenize", {"model": "gpt-9", "prompt": "x"}, "model")]:
        status, out = post(path, body)
        assert 400 <= status < 500 and out["error"]["param"] == param, (path, body, out)


def _sse(data: bytes) -> list[dict]:
    return [json.loads(e[len(b"data: "):]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


def test_bodies_validate_against_the_openai_packages_own_types(server):
    """The client builds its objects without validation; the package's pydantic types, validating, are
    the oracle for field names, types and required fields of every shape we send."""
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    def post(path: str, body: dict) -> bytes:
        status, _, data = server.raw("POST", path, json.dumps({"model": MODEL, **body}).encode())
        assert status == 200, data
        return data

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    ChatCompletion.model_validate_json(post("/v1/chat/completions", chat))
    for chunk in _sse(post("/v1/chat/completions", {**chat, "n": 2, "stream": True,
                                                    "stream_options": {"include_usage": True}})):
        ChatCompletionChunk.model_validate(chunk)
    Completion.model_validate_json(post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 2}))
    chunks = _sse(post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True,
                                           "stream_options": {"include_usage": True}}))
    for chunk in chunks:  # the package types a stream chunk as a Completion, whose finish_reason it requires
        if all(c["finish_reason"] for c in chunk["choices"]):  # (OpenAI sends null until the last)
            Completion.model_validate(chunk)
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
    Model.model_validate_json(server.raw("GET", f"/v1/models/{MODEL}")[2])
