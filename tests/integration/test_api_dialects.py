"""OpenAI's Responses API and Anthropic's Messages API through the whole graph with the official
`openai` and `anthropic` clients, on a tiny Qwen2 checkpoint written by transformers (float32, CPU):
greedy text equals transformers' generate on the prompt the chat template renders for the same
conversation, streamed and whole; a function tool's call comes back as a function_call item /
tool_use block whose arguments hold to the tool's schema, and its result sent back gives the text
transformers gives for that conversation."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from integration.test_correctness import cut_at_eos

MODEL = "tiny-qwen2"
EOS = 2  # the tiny checkpoint's eos_token_id (<|im_end|> of SmolLM2's tokenizer)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"]}
FUNCTION = {"name": "get_weather", "description": "Current weather of a city.", "parameters": PARAMETERS}
ASK = "What is the weather like in Paris?"


@pytest.fixture(scope="module")
def server(tiny_qwen2_server):
    return tiny_qwen2_server


@pytest.fixture(scope="module")
def oracle(oracles):
    return oracles("qwen2")


def openai_client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def anthropic_client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)


def greedy_text(oracle, prompt_ids: list[int], max_new: int) -> tuple[str, list[int]]:
    want = cut_at_eos(oracle.greedy(prompt_ids, max_new), {EOS})
    return oracle.tokenizer.decode(want, skip_special_tokens=True), want


def rendered(oracle, messages: list[dict], **kw) -> list[int]:
    """The prompt transformers renders with the checkpoint's chat template."""
    return list(oracle.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def chat_tokens(server, messages: list[dict], tools: list[dict]) -> list[int]:
    """The prompt of a chat conversation with tools, as the server renders it (vLLM's /tokenize): the
    template has no tools, so they are described in a system message (runtime/http/chat_messages.py)."""
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages, "tools": tools}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_responses_greedy_text_equals_transformers(server, oracle):
    api = openai_client(server)
    conversation = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another one?"}]
    prompt = rendered(oracle, [{"role": "system", "content": "Answer briefly."}, *conversation],
                      add_generation_prompt=True)
    want, ids = greedy_text(oracle, prompt, 24)
    items = [conversation[0], {"type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]}]
    kw = dict(model=MODEL, instructions="Answer briefly.", input=items, max_output_tokens=24, temperature=0)
    out = api.responses.create(**kw)
    assert out.output_text == want
    assert (out.usage.input_tokens, out.usage.output_tokens) == (len(prompt), len(ids))
    assert out.status == ("completed" if ids[-1] == EOS else "incomplete")

    events = list(api.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].type == f"response.{out.status}" and events[-1].response.output_text == want


def test_responses_function_call_and_its_output(server, oracle):
    api = openai_client(server)
    tools = [{"type": "function", **FUNCTION}]
    kw = dict(model=MODEL, input=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=150, temperature=0)
    out = api.responses.create(**kw)
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    assert out.status == "completed"

    events = list(api.responses.create(stream=True, **kw))
    [done] = [e for e in events if e.type == "response.output_item.done"]
    assert (done.item.type, done.item.name, done.item.arguments) == ("function_call", call.name, call.arguments)
    assert events[-1].type == "response.completed"

    # the client runs the function and sends its output back with the conversation (stateless)
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    answer = api.responses.create(model=MODEL, input=history, tools=tools, tool_choice="none", max_output_tokens=24,
                                  temperature=0)
    prompt = chat_tokens(server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}],
        [{"type": "function", "function": FUNCTION}])
    want, ids = greedy_text(oracle, prompt, 24)
    assert answer.output_text == want and answer.usage.input_tokens == len(prompt)
    assert [o.type for o in answer.output] == ["message"]


def test_anthropic_greedy_text_equals_transformers(server, oracle):
    api = anthropic_client(server)
    messages = [{"role": "user", "content": "Name a color."}]
    prompt = rendered(oracle, [{"role": "system", "content": "Answer briefly."}, *messages],
                      add_generation_prompt=True)
    want, ids = greedy_text(oracle, prompt, 24)
    kw = dict(model=MODEL, system="Answer briefly.", messages=messages, max_tokens=24, extra_body={"temperature": 0})
    out = api.messages.create(**kw)
    assert [(b.type, b.text) for b in out.content] == [("text", want)]
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(prompt)
    assert out.usage.output_tokens == len(ids)
    assert out.stop_reason == ("end_turn" if ids[-1] == EOS else "max_tokens")
    counted = api.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=messages)
    assert counted.input_tokens == len(prompt)

    with api.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want and final.content[0].text == want and final.stop_reason == out.stop_reason
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: the prefix cache served it

    # a stop sequence from the middle of the greedy text: the text before its first occurrence, and its name
    stop = want[len(want) // 2:len(want) // 2 + 3]
    assert stop.strip(), want
    out = api.messages.create(model=MODEL, system="Answer briefly.", messages=messages, max_tokens=24,
                              stop_sequences=["\u0000never", stop], extra_body={"temperature": 0})
    assert (out.content[0].text, out.stop_reason, out.stop_sequence) == (want[:want.index(stop)], "stop_sequence", stop)

    # a final assistant message is continued (Anthropic's prefill)
    prefill = [*messages, {"role": "assistant", "content": "My favourite"}]
    prompt = rendered(oracle, [{"role": "system", "content": "Answer briefly."}, *prefill],
                      continue_final_message=True)
    want, _ = greedy_text(oracle, prompt, 16)
    out = api.messages.create(model=MODEL, system="Answer briefly.", messages=prefill, max_tokens=16,
                              extra_body={"temperature": 0})
    assert out.content[0].text == want


def test_anthropic_tool_use_and_its_result(server, oracle):
    api = anthropic_client(server)
    tools = [{"name": FUNCTION["name"], "description": FUNCTION["description"], "input_schema": PARAMETERS}]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=tools, max_tokens=150,
              tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    out = api.messages.create(**kw)
    [call] = out.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, PARAMETERS)
    assert out.stop_reason == "tool_use"

    events = list(api.messages.create(stream=True, **kw))
    assert [e.type for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"]
    assert (events[1].content_block.name, json.loads(events[2].delta.partial_json)) == (call.name, call.input)
    with api.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", call.name, call.input)]

    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": out.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": '{"temperature": 21}'}]}]
    answer = api.messages.create(model=MODEL, messages=history, tools=tools, tool_choice={"type": "none"},
                                 max_tokens=24, extra_body={"temperature": 0})
    prompt = chat_tokens(server, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}],
        [{"type": "function", "function": FUNCTION}])
    want, ids = greedy_text(oracle, prompt, 24)
    assert [(b.type, b.text) for b in answer.content] == [("text", want)]
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == len(prompt)
