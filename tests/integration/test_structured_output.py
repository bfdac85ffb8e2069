"""Structured output and tool calling through the whole graph with the default model (SmolLM2-135M,
float32 on CPU) and real clients: the official `openai` client, LangChain's ChatOpenAI, httpx for
LightLLM's /generate. Every constrained answer is checked by an independent validator (jsonschema,
re, the JSON decoder); the token-level options against the unconstrained greedy answer."""
from __future__ import annotations

import asyncio
import functools
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, Field

from transformers import AutoTokenizer

from fixtures.json_schemas import SCHEMAS
from integration.conftest import SMOLLM2_DIR

MODEL = "smollm2-135m"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["zone"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _validator(schema: dict) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_34_json_schemas_each_give_output_that_validates(server):
    """All at once (one batch in the engine, each row with its own grammar), three ways to ask."""
    api = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    async def ask(i: int, topic: str, schema: dict) -> tuple[str, str]:
        prompt = f"Give {topic} as JSON."
        if i % 3 == 0:  # OpenAI's response_format
            out = await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=250,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                        "strict": True}})
            return out.choices[0].message.content, out.choices[0].finish_reason
        if i % 3 == 1:  # vLLM's structured_outputs, on a plain completion
            out = await api.completions.create(model=MODEL, prompt=prompt + "\n", temperature=0, max_tokens=250,
                                               extra_body={"structured_outputs": {"json": schema}})
            return out.choices[0].text, out.choices[0].finish_reason
        out = await api.chat.completions.create(  # vLLM's guided_json, as a JSON string
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=250,
            extra_body={"guided_json": json.dumps(schema)})
        return out.choices[0].message.content, out.choices[0].finish_reason

    async def all_of_them():
        try:
            return await asyncio.gather(*(ask(i, t, s) for i, (t, s) in enumerate(SCHEMAS)))
        finally:
            await api.close()

    answers = asyncio.run(all_of_them())
    assert len(SCHEMAS) >= 30
    for (topic, schema), (text, finish) in zip(SCHEMAS, answers):
        assert finish == "stop", f"{topic}: cut at max_tokens: {text!r}"
        _validator(schema).validate(json.loads(text))


def test_json_object_regex_choice_and_grammar(server):
    api = client(server)
    ask = [{"role": "user", "content": "Describe the sea."}]
    out = api.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=200,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)

    pattern = r"[A-Z][a-z]{2,8} [0-9]{1,2}, (19|20)[0-9]{2}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        out = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "When did WW2 end?"}],
                                          temperature=0, max_tokens=30, extra_body=extra)
        assert re.fullmatch(pattern, out.choices[0].message.content), out.choices[0].message.content

    choices = ["Paris", "London", "Berlin", "Madrid"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        out = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of Spain?"}],
                                          temperature=0, max_tokens=10, extra_body=extra)
        assert out.choices[0].message.content in choices

    grammar = 'root ::= "The answer is " number "."\nnumber ::= [1-9] [0-9]?'
    out = api.completions.create(model=MODEL, prompt="What is 6 times 7?", temperature=0, max_tokens=20,
                                 extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", out.choices[0].text), out.choices[0].text

    # a grammar that dead-ends after "Yes" (its rule b only refers to itself): the output ends there,
    # sampled too (a row with no allowed token once drew garbage from all -inf logits)
    for temperature in (0, 1.0):
        out = api.completions.create(model=MODEL, prompt="Is the sea blue?", temperature=temperature, seed=1,
                                     max_tokens=10, extra_body={"guided_grammar": 'root ::= "Yes" b\nb ::= b'})
        assert (out.choices[0].text, out.choices[0].finish_reason) == ("Yes", "stop")


def test_sampled_choices_each_keep_to_the_schema(server):
    schema = SCHEMAS[11][1]  # the shopping list: arrays of objects
    out = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A shopping list as JSON."}], n=3, temperature=1.0,
        seed=5, max_tokens=250, response_format={"type": "json_schema", "json_schema": {"name": "l", "schema": schema}})
    assert len(out.choices) == 3
    for c in out.choices:
        if c.finish_reason == "stop":
            _validator(schema).validate(json.loads(c.message.content))
    assert any(c.finish_reason == "stop" for c in out.choices)


def test_lightllm_generate_constraints(server):
    url = server.url + "/generate"
    r = httpx.post(url, json={"inputs": "The year the Berlin wall fell:", "parameters": {
        "max_new_tokens": 8, "regular_constraint": "(19|20)[0-9]{2}"}}, timeout=120)
    assert r.status_code == 200 and re.fullmatch("(19|20)[0-9]{2}", r.json()["generated_text"][0])
    schema = SCHEMAS[0][1]
    r = httpx.post(url, json={"inputs": "A person as JSON:", "parameters": {"max_new_tokens": 60,
                                                                           "guided_json": schema}}, timeout=120)
    _validator(schema).validate(json.loads(r.json()["generated_text"][0]))
    hf = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    allowed = [hf.convert_tokens_to_ids(x) for x in ("a", "b", "c")]
    r = httpx.post(url, json={"inputs": "Count: one, two,", "parameters": {
        "max_new_tokens": 3, "allowed_token_ids": allowed}}, timeout=120)
    assert re.fullmatch("[abc]{3}", r.json()["generated_text"][0]), r.json()
    r = httpx.post(url, json={"inputs": "x", "parameters": {"guided_json": {"type": "object", "uniqueItems": True}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "parameters.guided_json"


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


def test_openai_parse_and_named_tool_choice(server):
    api = client(server)
    out = api.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                     temperature=0, max_tokens=80, response_format=Person)
    assert isinstance(out.choices[0].message.parsed, Person)

    out = api.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL],
                                      tool_choice={"type": "function", "function": {"name": "get_time"}},
                                      temperature=0, max_tokens=60)
    ChatCompletion.model_validate(out.model_dump())  # the package's own types, validating, accept the shape
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    assert re.fullmatch("[A-Z]{3}", json.loads(call.function.arguments)["zone"])


def _call_of(call) -> tuple[str, dict]:
    return call.function.name, json.loads(call.function.arguments)


def test_required_tool_calls_stream_as_they_come_whole(server):
    api = client(server)
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
              temperature=0, max_tokens=120)
    whole = api.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    for call in whole.message.tool_calls:
        name, args = _call_of(call)
        schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[name]["function"]["parameters"]
        _validator(schema).validate(args)

    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in api.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function and d.function.name) or ""
                call["arguments"] += (d.function and d.function.arguments) or ""
    assert finish == "tool_calls" and content == ""
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert streamed == [_call_of(c) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_conversation_with_a_tool_result(server):
    api = client(server)
    first = api.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL],
                                        tool_choice="required", temperature=0, max_tokens=60).choices[0].message
    history = ASK_WEATHER + [first.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                              "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    out = api.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL], tool_choice="none",
                                      temperature=0, max_tokens=40)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_langchain_structured_output_and_bind_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=120,
                     max_retries=0, timeout=300)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, Person)
    person = llm.with_structured_output(Person, method="function_calling").invoke("Invent a person.")
    assert isinstance(person, Person)

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return "sunny"

    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome?")
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)


def _greedy(api, prompt: str, max_tokens: int, **extra):
    out = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens,
                                 extra_body=dict(return_token_ids=True, **extra))
    return out.choices[0]


def test_logit_bias_bad_words_min_tokens_min_p_and_allowed_ids(server):
    api = client(server)
    prompt = "The capital of France is"
    plain = _greedy(api, prompt, 12)
    first = plain.model_extra["token_ids"][0]
    # logit_bias -100 on the greedy first token: another one comes first; +100 on a token: it repeats
    assert _greedy(api, prompt, 1, logit_bias={str(first): -100}).model_extra["token_ids"][0] != first
    forced = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4,
                                    logit_bias={"1234": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [1234] * 4

    word = plain.text.split()[0].strip(".,")
    assert word and re.search(rf"\b{re.escape(word)}\b", plain.text)
    assert not re.search(rf"\b{re.escape(word)}\b", _greedy(api, prompt, 12, bad_words=[word]).text)

    short = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say OK."}],
                                        temperature=0, max_tokens=40)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say OK."}],
                                         temperature=0, max_tokens=40, extra_body={"min_tokens": 20})
    assert longer.usage.completion_tokens >= 20
    # stop strings count only once min_tokens are out (vLLM's rule); a stop on every space once ended it at once
    spaced = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=[" "],
                                    extra_body={"min_tokens": 6})
    text = spaced.choices[0].text
    assert spaced.usage.completion_tokens > 6 and plain.text.startswith(text) and " " in text.strip(), text

    # min_p = 1 keeps only the most likely token: sampling at temperature 1 is then greedy
    sampled = api.completions.create(model=MODEL, prompt=prompt, temperature=1.0, seed=3, max_tokens=12,
                                     extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == plain.text

    allowed = [1234, 2345, 3456]
    out = _greedy(api, prompt, 5, allowed_token_ids=allowed)
    assert set(out.model_extra["token_ids"]) <= set(allowed)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # isdigit() but not int(): once a 500
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),  # matches no text: once a mask of nothing (garbage out)
    ({"guided_grammar": "root ::= a\na ::= a"}, "guided_grammar"),
    # a call must name one function: nameless or twice-named tools were once served
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER_TOOL, TIME_TOOL, WEATHER_TOOL]}, "tools[2].function.name"),
    # JSON text nested deeper than Python's decoder recurses: once a 500 (RecursionError)
    ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),
    # specs the compiler would take seconds over (server.max_constraint_depth, server.max_constraint_chars)
    ({"guided_json": functools.reduce(lambda s, _: {"type": "array", "items": s}, range(100), {"type": "string"})},
     "guided_json"),
    ({"guided_choice": [f"choice {i}" for i in range(20000)]}, "guided_choice"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]},
     "messages[1].tool_calls"),
])
def test_bad_structured_requests_get_a_400_naming_the_field(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8,
                                               extra_body=body)
    assert e.value.body["param"].startswith(param), e.value.body


def test_a_slow_grammar_never_stalls_other_streams(server):
    """A schema that takes xgrammar seconds to compile: plain streams running meanwhile keep their pace
    (the workers compile it between steps while the router holds its request, which starts once every
    rank has it), and the constrained output still follows it."""
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 800 + i}
                                            for i in range(1200)}, "required": ["field_0"]}
    api = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)

    async def plain_gaps(done: asyncio.Event) -> list[float]:
        """Gaps between the tokens of plain streams, one after another until the constrained one is done."""
        gaps = []
        while not done.is_set():
            last = None
            stream = await api.completions.create(model=MODEL, prompt="Count slowly:", max_tokens=60,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
        return gaps

    async def constrained(done: asyncio.Event):
        t0 = time.perf_counter()
        try:
            out = await api.completions.create(model=MODEL, prompt="A record:", max_tokens=20, temperature=0,
                                               extra_body={"guided_json": big})
            return out.choices[0].text, time.perf_counter() - t0
        finally:
            done.set()

    async def both():
        done = asyncio.Event()
        try:
            return await asyncio.gather(plain_gaps(done), constrained(done))
        finally:
            await api.close()

    gaps, (text, seconds) = asyncio.run(both())
    assert text.startswith('{"field_0": "')
    # a compile on the step loop stops every stream for as long as it takes: about half the request's time
    assert gaps and max(gaps) < seconds / 4, f"a gap of {max(gaps):.2f} s between tokens in {seconds:.2f} s"
