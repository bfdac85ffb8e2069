"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over real HTTP with the
official `anthropic` client, a scripted engine behind the real frontend (unit/scripted_frontend.py):
the prompt is the chat path's for the same conversation, blocks, stop reasons, usage and stream
events are Anthropic's, whole equals streamed, and every error is in Anthropic's shape."""
from __future__ import annotations

import dataclasses
import json

import anthropic
import httpx
import pytest

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer

from unit.http_support import MODEL, REPLY, reply_text, smollm2_tokenizer
from unit.scripted_frontend import LIMITS, TOOL_REPLY, Server

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not

WEATHER = {"name": "get_weather", "description": "Weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    """Room for the tools' system message and the scripted calls."""
    server = Server(tok, limits=dataclasses.replace(LIMITS, max_model_len=1024))
    yield server
    server.stop()


def client(server, api_key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=api_key, max_retries=0, timeout=10)


def last_prompt(server) -> list[int]:
    return server.engine.added()[-1].prompt_ids


def chat_prompt(server, messages: list[dict], **kw) -> list[int]:
    """The prompt the chat path renders for the same conversation."""
    server.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **kw)
    return last_prompt(server)


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{server.port}{path}", json=body, timeout=10, **kw)


def test_text_message(server, tok):
    out = client(server).messages.create(model=MODEL, max_tokens=5, messages=HELLO, extra_body={"temperature": 0},
                                         system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}])
    prompt = last_prompt(server)
    assert prompt == chat_prompt(server, [{"role": "system", "content": "Be brief."}, *HELLO])
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_") and out.model == MODEL
    assert [(b.type, b.text) for b in out.content] == [("text", reply_text(tok, 5))]
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert (out.usage.input_tokens + out.usage.cache_read_input_tokens, out.usage.output_tokens) == (len(prompt), 5)
    done = client(server).messages.create(model=MODEL, max_tokens=64, messages=HELLO)
    assert done.stop_reason == "end_turn" and done.content[0].text == REPLY
    count = client(server).messages.count_tokens(model=MODEL, messages=HELLO, system="Be brief.")
    assert count.input_tokens == len(prompt)


def test_stream_events_are_anthropics_and_add_up_to_the_whole(server):
    kw = dict(model=MODEL, max_tokens=64, messages=HELLO)
    whole = client(server).messages.create(**kw)
    events = list(client(server).messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == whole.usage.output_tokens
    with client(server).messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text and final.stop_reason == "end_turn"


def test_tool_use_blocks_and_tool_results(server, tok):
    api = client(server)
    kw = dict(model=MODEL, max_tokens=64, tools=[WEATHER], messages=[{"role": "user", "content": "toolcall"}])
    out = api.messages.create(**kw)
    assert [(b.type, b.name, b.input) for b in out.content] == [("tool_use", "get_weather", {"city": "Paris"}),
                                                                ("tool_use", "get_weather", {"city": "London"})]
    assert out.stop_reason == "tool_use" and all(b.id.startswith("toolu_") for b in out.content)
    assert last_prompt(server) == chat_prompt(server, [{"role": "user", "content": "toolcall"}], tools=[CHAT_WEATHER])

    events = list(api.messages.create(stream=True, **kw))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [(b.type, b.name, b.input) for b in starts] == [("tool_use", "get_weather", {})] * 2
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert [json.loads(p) for p in partial] == [b.input for b in out.content]
    with api.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in out.content]
    assert final.stop_reason == "tool_use"

    # the client sends the calls back with their results
    results = [{"type": "tool_result", "tool_use_id": b.id, "content": [{"type": "text", "text": "sunny"}]}
               for b in out.content]
    history = [{"role": "user", "content": "toolcall"}, {"role": "assistant", "content": out.content},
               {"role": "user", "content": [*results, {"type": "text", "text": "And so?"}]}]
    answer = api.messages.create(model=MODEL, max_tokens=3, tools=[WEATHER], tool_choice={"type": "none"},
                                 messages=history)
    assert answer.content[0].text == tok.decode(tok.hf.encode(TOOL_REPLY, add_special_tokens=False)[:3])
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in out.content]
    assert last_prompt(server) == chat_prompt(server, [
        {"role": "user", "content": "toolcall"}, {"role": "assistant", "tool_calls": calls},
        *[{"role": "tool", "tool_call_id": b.id, "content": "sunny"} for b in out.content],
        {"role": "user", "content": "And so?"}], tools=[CHAT_WEATHER], tool_choice="none")


def test_tool_choice_top_k_and_output_format_reach_the_engine(server):
    api = client(server)
    api.messages.create(model=MODEL, max_tokens=8, messages=HELLO, tools=[WEATHER],
                        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    named = server.engine.added()[-1].sampling.constraint
    assert named.kind == "structural_tag" and "get_weather" in named.spec
    api.messages.create(model=MODEL, max_tokens=8, messages=HELLO, tools=[WEATHER], tool_choice={"type": "any"})
    assert server.engine.added()[-1].sampling.constraint.kind == "structural_tag"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    api.messages.create(model=MODEL, max_tokens=8, messages=HELLO,
                        output_config={"format": {"type": "json_schema", "schema": schema}})
    constraint = server.engine.added()[-1].sampling.constraint
    assert constraint.kind == "json_schema" and json.loads(constraint.spec) == schema
    # the sampling fields the API has taken (the client of this version sends them as extra fields)
    api.messages.create(model=MODEL, max_tokens=8, messages=HELLO, extra_body={"top_k": 5, "top_p": 0.5,
                                                                              "temperature": 0.5})
    sampling = server.engine.added()[-1].sampling
    assert (sampling.top_k, sampling.top_p, sampling.temperature) == (5, 0.5, 0.5)


def test_stop_sequences_name_the_one_that_hit(server, tok):
    """The scripted engine's detokenizer stops at the third token (" brown"): the client gets the text
    before it, stop_reason stop_sequence and which sequence it was."""
    kw = dict(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "stopword"}],
              stop_sequences=["zebra", " brown"])
    out = client(server).messages.create(**kw)
    assert server.engine.added()[-1].sampling.stop == ["zebra", " brown"]
    assert (out.content[0].text, out.stop_reason, out.stop_sequence) == (reply_text(tok, 2), "stop_sequence", " brown")
    with client(server).messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert (text, final.stop_reason, final.stop_sequence) == (reply_text(tok, 2), "stop_sequence", " brown")


def test_a_final_assistant_message_is_continued(server, tok):
    messages = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "The answer is"}]}]
    client(server).messages.create(model=MODEL, max_tokens=3, messages=messages)
    rendered = tok.encode_chat([*HELLO, {"role": "assistant", "content": "The answer is"}],
                               add_generation_prompt=False, continue_final_message=True)
    assert last_prompt(server) == rendered


@pytest.mark.parametrize("body,status,kind,says", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "`system`"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, 400, "invalid_request_error",
     "runs no tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"tools": [{"name": "x"}]}, 400, "invalid_request_error", "input_schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA"}}]}]}, 400, "invalid_request_error", "text only"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text"}}]}]}, 400,
     "invalid_request_error", "document"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "reasoning_parser"),
    ({"max_tokens": 100000}, 400, "invalid_request_error", "max_tokens"),
    ({"stop_sequences": ["x" * 10000]}, 400, "invalid_request_error", "stop_sequences"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, 400, "invalid_request_error", "runs no tools"),
])
def test_errors_are_in_anthropics_shape(server, body, status, kind, says):
    full = {"model": MODEL, "max_tokens": 4, "messages": HELLO, **body}
    r = post(server, "/v1/messages", {k: v for k, v in full.items() if v is not None})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"], error


def test_the_clients_errors_and_api_key(tok):
    srv = Server(tok, api_key="sekret")
    try:
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(srv, "wrong").messages.create(model=MODEL, max_tokens=2, messages=HELLO)
        assert e.value.body["error"]["type"] == "authentication_error"
        assert client(srv, "sekret").messages.create(model=MODEL, max_tokens=2, messages=HELLO).content[0].text
        with pytest.raises(anthropic.NotFoundError):
            client(srv, "sekret").messages.create(model="claude-3-haiku", max_tokens=2, messages=HELLO)
        with pytest.raises(anthropic.InternalServerError):
            client(srv, "sekret").messages.create(model=MODEL, max_tokens=8, messages=[
                {"role": "user", "content": "broken"}])
        with pytest.raises(anthropic.APIStatusError) as e:  # mid-stream: an error event
            list(client(srv, "sekret").messages.create(model=MODEL, max_tokens=8, stream=True, messages=[
                {"role": "user", "content": "broken"}]))
        assert e.value.body["error"]["type"] == "api_error"
    finally:
        srv.stop()


def test_unknown_fields_follow_server_unknown_fields(server, tok):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi", "mood": 1}],
            "tools": [dict(WEATHER, knob=2)], "frobnicate": 1}
    r = post(server, "/v1/messages", body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert set(r.headers["X-Ignored-Fields"].split(", ")) == {"frobnicate", "messages[0].mood", "tools[0].knob"}
    strict = Server(tok, warn_unknown_fields=False)
    try:
        r = post(strict, "/v1/messages", body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "server.unknown_fields" in r.json()["error"]["message"]
    finally:
        strict.stop()


def test_a_thinking_models_reasoning_is_a_thinking_block(tok):
    """server.reasoning_parser=qwen3: the <think> block comes back as a thinking block before the text,
    split as chat splits it; thinking enabled is served; a thinking block sent back is dropped."""
    srv = Server(tok, limits=dataclasses.replace(LIMITS, max_model_len=1024, reasoning_parser="qwen3"))
    try:
        chat = srv.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "thinking"}],
                                                    max_tokens=64).choices[0].message
        kw = dict(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "thinking"}],
                  thinking={"type": "enabled", "budget_tokens": 1024})
        out = client(srv).messages.create(**kw)
        assert [b.type for b in out.content] == ["thinking", "text"] and out.stop_reason == "end_turn"
        assert (out.content[0].thinking, out.content[1].text) == (chat.model_extra["reasoning_content"], chat.content)
        with client(srv).messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [
            ("thinking", out.content[0].thinking), ("text", out.content[1].text)]
        history = [*HELLO, {"role": "assistant", "content": out.content}, {"role": "user", "content": "More"}]
        client(srv).messages.create(model=MODEL, max_tokens=2, messages=history)
        assert last_prompt(srv) == chat_prompt(srv, [*HELLO, {"role": "assistant", "content": out.content[1].text},
                                                     {"role": "user", "content": "More"}])
    finally:
        srv.stop()
