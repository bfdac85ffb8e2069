"""OpenAI's Responses API (POST /v1/responses) over real HTTP with the official `openai` client, a
scripted engine behind the real frontend (unit/scripted_frontend.py): the prompt is the chat path's
for the same conversation, the output items and stream events are OpenAI's, whole equals streamed,
and what llaunch does not serve (stored responses, built-in tools) is a 400 that says why."""
from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer

from unit.http_support import MODEL, REPLY, reply_text, smollm2_tokenizer
from unit.scripted_frontend import LIMITS, TOOL_REPLY, Server

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def server(tok):
    """Room for the tools' system message and the scripted calls."""
    server = Server(tok, limits=dataclasses.replace(LIMITS, max_model_len=1024))
    yield server
    server.stop()


def last_prompt(server) -> list[int]:
    return server.engine.added()[-1].prompt_ids


def chat_prompt(server, messages: list[dict], **kw) -> list[int]:
    """The prompt the chat path renders for the same conversation."""
    server.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **kw)
    return last_prompt(server)


def post(server, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{server.port}/v1/responses", json=body, timeout=10, **kw)


def test_text_response(server, tok):
    out = server.openai().responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=5,
                                           temperature=0)
    prompt = last_prompt(server)
    assert prompt == chat_prompt(server, [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hello"}])
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.output_text == reply_text(tok, 5)
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    usage = out.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (len(prompt), 5, len(prompt) + 5)
    assert out.store is False and out.instructions == "Be brief." and out.temperature == 0

    done = server.openai().responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hel"}, {"type": "input_text", "text": "lo"}]}], max_output_tokens=64)
    assert done.status == "completed" and done.incomplete_details is None and done.output_text == REPLY
    assert last_prompt(server) == chat_prompt(server, [{"role": "user", "content": "Hello"}])


def test_stream_events_are_openais_and_add_up_to_the_whole(server, tok):
    kw = dict(model=MODEL, input="Hello", max_output_tokens=64)
    whole = server.openai().responses.create(**kw)
    events = list(server.openai().responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-4].text == whole.output_text and events[-1].response.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.usage == whole.usage
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[2].item.id}
    # the client's own accumulator takes the events
    with server.openai().responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


def test_function_calls_come_back_as_items_and_their_outputs_go_back_in(server, tok):
    api = server.openai()
    kw = dict(model=MODEL, input="toolcall", tools=[WEATHER], max_output_tokens=64)
    out = api.responses.create(**kw)
    assert [(o.type, o.name, json.loads(o.arguments)) for o in out.output] == [
        ("function_call", "get_weather", {"city": "Paris"}), ("function_call", "get_weather", {"city": "London"})]
    assert all(o.call_id.startswith("call_") and o.id.startswith("fc_") and o.status == "completed" for o in out.output)
    assert out.status == "completed" and out.tools[0].name == "get_weather"
    assert last_prompt(server) == chat_prompt(server, [{"role": "user", "content": "toolcall"}], tools=[CHAT_WEATHER])

    events = list(api.responses.create(stream=True, **kw))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name) for i in added] == [("function_call", "get_weather")] * 2
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert args == [o.arguments for o in out.output]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == "".join(args)
    with api.responses.stream(**kw) as stream:
        streamed = stream.get_final_response()
    assert [(o.name, o.arguments) for o in streamed.output] == [(o.name, o.arguments) for o in out.output]

    # the client sends the calls back with their results (openai's own objects, model_dump'ed)
    history = [{"role": "user", "content": "toolcall"}, *[o.model_dump(exclude_none=True) for o in out.output],
               *[{"type": "function_call_output", "call_id": o.call_id, "output": "sunny"} for o in out.output]]
    answer = api.responses.create(model=MODEL, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=3)
    # tool_choice none: the reply is text
    assert answer.output_text == tok.decode(tok.hf.encode(TOOL_REPLY, add_special_tokens=False)[:3])
    calls = [{"id": o.call_id, "type": "function", "function": {"name": o.name, "arguments": o.arguments}}
             for o in out.output]
    assert last_prompt(server) == chat_prompt(server, [
        {"role": "user", "content": "toolcall"}, {"role": "assistant", "tool_calls": calls},
        *[{"role": "tool", "tool_call_id": o.call_id, "content": "sunny"} for o in out.output]],
        tools=[CHAT_WEATHER], tool_choice="none")


def test_tool_choice_and_text_format_reach_the_grammar(server):
    api = server.openai()
    api.responses.create(model=MODEL, input="Hi", tools=[WEATHER], max_output_tokens=8,
                         tool_choice={"type": "function", "name": "get_weather"})
    named = server.engine.added()[-1].sampling.constraint
    assert named.kind == "structural_tag" and "get_weather" in named.spec
    api.responses.create(model=MODEL, input="Hi", tools=[WEATHER], parallel_tool_calls=False, tool_choice="required",
                         max_output_tokens=8)
    assert server.engine.added()[-1].sampling.constraint.kind == "structural_tag"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    api.responses.create(model=MODEL, input="Hi", max_output_tokens=8,
                         text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    constraint = server.engine.added()[-1].sampling.constraint
    assert constraint.kind == "json_schema" and json.loads(constraint.spec) == schema
    api.responses.create(model=MODEL, input="Hi", max_output_tokens=8, text={"format": {"type": "json_object"}})
    assert server.engine.added()[-1].sampling.constraint.kind == "json_object"
    api.responses.create(model=MODEL, input="Hi", max_output_tokens=8, top_p=0.5, temperature=0.7)
    sampling = server.engine.added()[-1].sampling
    assert (sampling.top_p, sampling.temperature) == (0.5, pytest.approx(0.7))


@pytest.mark.parametrize("body,param,says", [
    ({"store": True}, "store", "keeps no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"background": True}, "background", "keeps no responses"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "keeps no responses"),
    ({"tools": [{"type": "web_search", "user_location": {"type": "approximate"}}]}, "tools[0].type", "runs no tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "runs no tools"),
    ({"input": None}, "input", "required"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "context length"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "text.format", "uniqueItems"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "yaml"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "names no function"),
    ({"tools": [{**WEATHER, "name": ""}]}, "tools[0].name", "empty"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{"}]}, "input[1].arguments", "not JSON"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "input[0].content[0]", "text only"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type",
     "input_file"),
    ({"include": ["message.output_text.logprobs"]}, "include", "reasoning.encrypted_content"),
    ({"truncation": "auto"}, "truncation", "not cut"),
])
def test_what_is_not_served_is_a_400_that_says_why(server, body, param, says):
    r = post(server, {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_store_false_and_stateless_fields_are_served(server):
    r = post(server, {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False, "metadata": {"a": "b"},
                      "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"],
                      "truncation": "disabled", "text": {"format": {"type": "text"}, "verbosity": "low"}})
    assert r.status_code == 200 and r.json()["store"] is False and "X-Ignored-Fields" not in r.headers, r.text


def test_unknown_fields_follow_server_unknown_fields(server, tok):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "frobnicate": 1, "tools": [dict(WEATHER, knob=2)]}
    r = post(server, body)
    assert r.status_code == 200 and r.headers["X-Ignored-Fields"] == "frobnicate, tools[0].knob", r.text
    strict = Server(tok, warn_unknown_fields=False)
    try:
        r = post(strict, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        r = post(strict, {k: v for k, v in body.items() if k != "frobnicate"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].knob", r.text
        assert "server.unknown_fields" in r.json()["error"]["message"]
    finally:
        strict.stop()


def test_an_engine_failure_mid_stream_is_response_failed(server):
    events = list(server.openai().responses.create(model=MODEL, input="broken", max_output_tokens=8, stream=True))
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.message
    with pytest.raises(openai.InternalServerError):
        server.openai().responses.create(model=MODEL, input="broken", max_output_tokens=8)


def test_a_thinking_models_reasoning_is_a_reasoning_item(tok):
    """server.reasoning_parser=qwen3: the <think> block comes back as a reasoning item before the message,
    split as chat splits it; a reasoning item sent back is dropped from the prompt."""
    srv = Server(tok, limits=dataclasses.replace(LIMITS, max_model_len=1024, reasoning_parser="qwen3"))
    try:
        chat = srv.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "thinking"}],
                                                    max_tokens=64).choices[0].message
        kw = dict(model=MODEL, input="thinking", max_output_tokens=64)
        out = srv.openai().responses.create(**kw)
        [thought, message] = out.output
        assert thought.type == "reasoning" and thought.content[0].text == chat.model_extra["reasoning_content"]
        assert message.type == "message" and out.output_text == chat.content
        events = list(srv.openai().responses.create(stream=True, **kw))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.content[0].text
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
        assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
        history = [{"role": "user", "content": "Hi"}, thought.model_dump(exclude_none=True),
                   message.model_dump(exclude_none=True), {"role": "user", "content": "More"}]
        srv.openai().responses.create(model=MODEL, input=history, max_output_tokens=2)
        assert last_prompt(srv) == chat_prompt(srv, [{"role": "user", "content": "Hi"},
                                                     {"role": "assistant", "content": out.output_text},
                                                     {"role": "user", "content": "More"}])
    finally:
        srv.stop()
