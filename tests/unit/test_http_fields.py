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
    # names a fuzzer finds: backticks, control characters, non-ASCII; the header stays ASCII
    weird = {"f`N\u0000x": 1, "\u00e9\n` - at `$.messages": [1], "\u00ff\u0007": {}}
    r = httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", timeout=10, headers={
        "Content-Type": "application/json"}, content=json.dumps(
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi", **weird}], **weird}))
    assert r.status_code == 200, r.text
    assert r.headers["X-Ignored-Fields"].isascii() and r.headers["X-Ignored-Fields"].count("messages[0].") == 3
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


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_lightllm_payloads_are_served(server, tok):
    """LightLLM's benchmark clients send `add_special_tokens` and the rest of its sampling parameters."""
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "add_special_tokens": False, "do_sample": False,
                                              "skip_special_tokens": True, "add_spaces_between_special_tokens": True,
                                              "print_eos_token": True, "image_max_patch_num": -1,
                                              "suggested_dp_index": 1}}
    r, events = sse(server, "/generate_stream", body)
    assert r.status_code == 200 and len(events) == 3
    sent = server.engine.added()[-1]
    assert sent.prompt_ids == tok.encode_plain("Hello")
    assert sent.sampling.spaces_between_special_tokens and sent.sampling.stop_token_text
    assert [replica for replica, m in server.engine.received if m is sent] == [1]  # the suggested replica
    assert post(server, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).status_code == 200
    assert not server.engine.added()[-1].sampling.stop_token_text  # LightLLM leaves the eos text out
    for parameters, field in [({"exponential_decay_length_penalty": [4, 1.2]}, "exponential_decay_length_penalty"),
                              ({"group_request_id": 7}, "group_request_id"),
                              ({"input_penalty": True, "frequency_penalty": 0.5}, "input_penalty")]:
        r = post(server, "/generate", {"inputs": "Hello", "parameters": parameters})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"parameters.{field}", r.text
        assert "not supported:" in r.json()["error"]["message"]


def test_openai_fields_clients_send_are_served_or_refused_with_the_reason(server, tok):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    accepted = {"store": True, "service_tier": "auto", "reasoning_effort": "low", "verbosity": "low",
                "metadata": {"k": "v"}, "user": "u", "safety_identifier": "s", "prompt_cache_key": "k",
                "prediction": {"type": "content", "content": "x"}, "modalities": ["text"],
                "include_reasoning": False, "parallel_tool_calls": True, "length_penalty": 1.0}
    r = post(server, "/v1/chat/completions", {**chat, **accepted})
    assert r.status_code == 200 and "X-Ignored-Fields" not in r.headers, r.text
    # the predicted output travels with the request, for spec=ngram's lookup (tests/integration/test_predicted_output.py)
    assert server.engine.added()[-1].prediction_ids == tok.encode_plain("x")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and server.engine.added()[-1].prediction_ids == []
    refused = {"use_beam_search": True, "length_penalty": 0.5, "logits_processors": ["x.Y"], "cache_salt": "s",
               "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "guided_whitespace_pattern": " ",
               "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
               "web_search_options": {}, "moderation": {"model": "m"}, "mm_processor_kwargs": {"a": 1},
               "token_healing": True}
    for name, value in refused.items():
        r = post(server, "/v1/chat/completions", {**chat, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        assert "not supported:" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "token_healing": True})
    assert r.status_code == 200  # completions heal
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "prompt_embeds": "AAAA"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds"
    r = post(server, "/v1/chat/completions", {**chat, "logit_bias": [0.5]})  # TGI's list form
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_vllm_request_options(server, tok):
    body = {"model": MODEL, "prompt": "one two three four five", "max_tokens": 2, "priority": -5,
            "request_id": "abc123", "truncate_prompt_tokens": 2, "add_special_tokens": False, "do_sample": False,
            "temperature": 0.9, "spaces_between_special_tokens": True, "include_stop_str_in_output": True,
            "logprobs": 1, "return_tokens_as_token_ids": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out, sent = r.json(), server.engine.added()[-1]
    assert out["id"] == "cmpl-abc123"
    assert sent.priority == -5 and sent.prompt_ids == tok.encode_plain("one two three four five")[-2:]
    assert sent.sampling.greedy and sent.sampling.spaces_between_special_tokens and sent.sampling.stop_token_text
    assert all(t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"])
    assert not post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}).json() is None
    assert not server.engine.added()[-1].sampling.stop_token_text  # vLLM: the eos text only when asked
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 3, "n": 1, "best_of": 3, "request_id": "r1"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-r1" and len(r.json()["choices"]) == 1
    assert len(server.engine.added()[-3:]) == 3 and all(a.sampling.logprobs for a in server.engine.added()[-3:])


def test_chat_template_options_reach_the_template(tok):
    server = Server(tok, limits=msgspec_replace_limits(trust_request_chat_template=True))
    try:
        template = ("{{ greeting }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                    "{% if add_generation_prompt %}[assistant:{% endif %}{{ role_setting.mood if role_setting }}")
        body = {"model": MODEL, "max_tokens": 2, "chat_template": template, "chat_template_kwargs": {"greeting": "Ahoy"},
                "role_settings": {"mood": "calm"}, "messages": [{"role": "user", "content": "hi"}]}
        assert post(server, "/v1/chat/completions", body).status_code == 200
        assert tok.decode(server.engine.added()[-1].prompt_ids) == "Ahoy[user:hi][assistant:calm"
        r = post(server, "/v1/chat/completions", dict(body, chat_template_kwargs={"add_generation_prompt": False}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"
    finally:
        server.stop()


def msgspec_replace_limits(**kw):
    import dataclasses

    from unit.scripted_frontend import LIMITS
    return dataclasses.replace(LIMITS, **kw)


def test_continue_final_message_and_echo(server, tok):
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there,"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3,
                                              "continue_final_message": True, "add_generation_prompt": False,
                                              "echo": True})
    assert r.status_code == 200, r.text
    want = tok.hf.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert tok.decode(server.engine.added()[-1].prompt_ids) == want and want.endswith("Hi there,")
    assert r.json()["choices"][0]["message"]["content"].startswith("Hi there," + REPLY[:4])
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages[:1], "max_tokens": 2,
                                              "chat_template": "{{ messages }}"})
    assert r.status_code == 400 and "server.trust_request_chat_template" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages[:1], "max_tokens": 2,
                                              "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200  # a variable the template does not use changes nothing


@pytest.fixture(scope="module")
def wide(tok):
    """A server with room for the tools' system message and TOOL_REPLY."""
    server = Server(tok, limits=msgspec_replace_limits(max_model_len=1024))
    yield server
    server.stop()


def test_a_tool_call_cut_by_max_tokens_is_neither_content_nor_a_call(wide, tok):
    """The second call of the reply is cut off: no `<tool_call>` text in content (it leaked there beside
    the parsed call), no call with arguments that are not JSON; the first call, and finish_reason length."""
    from unit.scripted_frontend import TOOL_REPLY
    cut_at = len(tok.hf.encode(TOOL_REPLY, add_special_tokens=False)) - 6
    body = {"model": MODEL, "messages": [{"role": "user", "content": "toolcall please"}], "tools": TOOLS,
            "max_tokens": cut_at}
    out = wide.openai().chat.completions.create(**body)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    chunks = list(wide.openai().chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [tc.function.name for tc in calls if tc.function.name] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_functions_are_served_as_one_function_call(wide, tok):
    functions = [t["function"] for t in TOOLS]
    out = wide.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "toolcall please"}], functions=functions, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    assert choice.message.function_call.arguments == '{"city": "Paris"}'


def test_structured_output_shapes_of_vllm_and_tgi(server, tok):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for extra, kind in [({"response_format": {"type": "json", "value": schema}}, "json_schema"),
                        ({"response_format": {"type": "regex", "value": "[ab]+"}}, "regex"),
                        ({"response_format": {"type": "json_schema", "value": {"name": "x", "schema": schema}}},
                         "json_schema"),
                        ({"structural_tag": json.dumps({"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
                                                        "triggers": ["<f"]})}, "structural_tag"),
                        ({"response_format": {"type": "structural_tag", "triggers": ["<f"],
                                              "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}]}},
                         "structural_tag")]:
        r = post(server, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert server.engine.added()[-1].sampling.constraint.kind == kind


def test_lightllm_operations_routes(server, tok):
    base = f"http://127.0.0.1:{server.port}"
    assert httpx.get(base + "/healthz").json() == {"message": "Ok"}
    assert httpx.get(base + "/liveness").json() == httpx.post(base + "/readiness").json() == {"status": "ok"}
    assert httpx.get(base + "/get_model_name").json() == {"model_name": MODEL}
    assert httpx.get(base + "/get_server_info").json()["model_name"] == MODEL
    load = httpx.get(base + "/token_load").json()
    assert set(load) == {"current_load", "logical_max_load", "dynamic_max_load"} and len(load["current_load"]) == 2
    r = httpx.request("GET", base + "/tokens", json={"text": "Hello world", "parameters": {}})
    assert r.json() == {"ntokens": len(tok.encode("Hello world"))}


def test_huggingface_hub_chat_completion_under_the_tgi_api(server, tok):
    """huggingface_hub's InferenceClient(base_url).chat_completion sends model "dummy": TGI serves its one
    model whatever the name, and so does server.tgi_api."""
    from huggingface_hub import InferenceClient

    tgi = Server(tok, limits=msgspec_replace_limits(ignore_model_name=True))
    try:
        client = InferenceClient(base_url=f"http://127.0.0.1:{tgi.port}")
        out = client.chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4)
        assert out.choices[0].message.content == tok.decode(tok.encode_plain(REPLY)[:4])
        assert tgi.engine.added()[-1].sampling.max_new_tokens == 4
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4, stream=True))
        assert streamed == out.choices[0].message.content
    finally:
        tgi.stop()
    r = post(server, "/v1/chat/completions", {"model": "dummy", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"  # elsewhere a name must be the model's


def test_older_and_vllm_message_fields_reach_the_template(server, tok):
    """An assistant turn with OpenAI's older `function_call` and its `function` result, a `refusal`, and
    vLLM's /tokenize with the chat options of chat completions."""
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "refusal": None,
                 "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"role": "function", "name": "get_weather", "content": "sunny"}]
    r = post(server, "/tokenize", {"model": MODEL, "messages": messages, "return_token_strs": False})
    assert r.status_code == 200, r.text
    text = tok.decode(r.json()["tokens"])
    assert "get_weather" in text and "sunny" in text
    r = post(server, "/tokenize", {"model": MODEL, "messages": [*messages[:1], {"role": "assistant", "content": "It is"}],
                                   "continue_final_message": True})
    assert r.status_code == 200 and tok.decode(r.json()["tokens"]).endswith("It is")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "audio": {"id": "a1"}}, {"role": "user", "content": "y"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].audio"
