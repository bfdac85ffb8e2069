"""What real clients send, over real HTTP to the frontend with a scripted engine behind it
(unit/scripted_frontend.py): vLLM's stream_options.continuous_usage_stats (guidellm sends it on every
streaming request), fields no API defines (server.unknown_fields), and the other fields of the OpenAI,
vLLM, TGI and LightLLM APIs: served, or a 400 that says why not."""
from __future__ import annotations

import json

import httpx
import pytest

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer

from unit.http_support import MODEL, REPLY, smollm2_tokenizer
from unit.scripted_frontend import Server


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def server(scripted_server):
    return scripted_server


def sse(server, path: str, body: dict) -> tuple[httpx.Response, list[dict]]:
    with httpx.stream("POST", f"http://127.0.0.1:{server.port}{path}", json=body, timeout=10) as r:
        events = [json.loads(line[len("data:"):]) for line in r.iter_lines()
                  if line.startswith("data:") and line.strip() != "data: [DONE]"]
    return r, events


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{server.port}{path}", json=body, timeout=10, **kw)


def test_guidellm_streams_get_usage_in_every_chunk(server, tok):
    """guidellm 0.8.1's streaming bodies, as its OpenAI request handlers build them."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"model": MODEL, "stream": True, "stream_options": options, "max_completion_tokens": 6, "stop": None,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Hello"}]}
    completion = {"model": MODEL, "stream": True, "stream_options": options, "max_tokens": 6, "stop": None,
                  "ignore_eos": True, "prompt": "Hello"}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        r, events = sse(server, path, body)
        assert r.status_code == 200, path
        assert all(e["usage"] is not None for e in events), path
        counts = [e["usage"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == 6  # what has been generated so far, then the total
        assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] > 0
    r, events = sse(server, "/v1/completions", dict(completion, stream_options={"include_usage": True}))
    assert [e["usage"] is None for e in events] == [True] * (len(events) - 1) + [False]  # usage once, at the end


def test_a_field_no_api_defines_is_served_and_named(server, tok, caplog):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "frobnicate": 1,
            "stream_options": None, "response_format": {"type": "text", "extra_knob": True}}
    with caplog.at_level("WARNING"):
        r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.headers["X-Ignored-Fields"] == "frobnicate, response_format.extra_knob"
    assert "frobnicate" in caplog.text
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert "X-Ignored-Fields" not in r.headers
    r = post(server, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "mystery": 3}})
    assert r.status_code == 200 and r.headers["X-Ignored-Fields"] == "parameters.mystery"
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": "three", "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # a wrong value is still refused


def test_server_unknown_fields_reject_names_the_field(tok):
    server = Server(tok, warn_unknown_fields=False)
    try:
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                  "frobnicate": 1})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "frobnicate" and "server.unknown_fields" in r.json()["error"]["message"]
    finally:
        server.stop()
