"""Tool calls parsed back from generated text, whole and streamed: the stream, fed in any split,
reassembles to the same calls and the same content as the whole-text parse; the grammar of a call
bounds its whitespace."""
from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr

from llaunch.runtime.constrained.compiler import GrammarCompiler
from llaunch.runtime.http.openai_protocol import ChatCompletionRequest, FunctionDefinition, Tool
from llaunch.runtime.http.tool_calls import (MAX_CALL_WHITESPACE, ToolCallStream, call_text, parse_tool_calls,
                                             tools_constraint)

from unit.http_support import smollm2_tokenizer

WEATHER = {"city": "Paris", "days": [1, 2], "unit": "°C"}
TEXTS = {
    "hermes": [
        call_text("hermes", "get_weather", WEATHER),
        "Let me check. " + call_text("hermes", "get_weather", WEATHER) + "\n" + call_text("hermes", "time", {}),
        "No tools needed: 2 < 3 and <tool is not a tag.",
        "  padded   \n" + call_text("hermes", "a", {}) + "\n\n  and more  " + call_text("hermes", "b", {}) + "\n",
        "<tool_call>\n{\"name\": \"broken\", \"arguments\": {</tool_call> then text",  # not JSON: content
        "<tool_call>\n{\"name\": \"cut\", \"argu",  # cut by max_tokens: content
    ],
    "llama3_json": [
        call_text("llama3_json", "get_weather", WEATHER),
        call_text("llama3_json", "a", {"x": 1}) + "; " + call_text("llama3_json", "b", {"y": "}{"}),
        "Plain answer with {braces} but no call.",
        '{"name": "cut", "parameters": {"x"',
    ],
}


def _reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            call["name"] += c.get("function", {}).get("name", "")
            call["arguments"] += c.get("function", {}).get("arguments", "")
            if "id" in c:
                assert c["type"] == "function" and c["id"].startswith("call_")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("fmt,text", [(f, t) for f, texts in TEXTS.items() for t in texts])
def test_stream_in_any_split_matches_the_whole_parse(fmt, text):
    content, calls = parse_tool_calls(text, fmt)
    want_calls = [{"name": c.name, "arguments": c.arguments} for c in calls]
    for seed in range(5):
        rng, stream, deltas, at = random.Random(seed), ToolCallStream(fmt), [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            deltas += stream.feed(text[at:at + step])
            at += step
        deltas += stream.finish()
        got_content, got_calls = _reassemble(deltas)
        assert got_calls == want_calls
        assert got_content == (content or "")


def test_calls_and_content_of_whole_text():
    content, calls = parse_tool_calls(TEXTS["hermes"][1], "hermes")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("time", {})]
    assert parse_tool_calls(TEXTS["hermes"][0], "hermes")[0] is None  # only a call: content is null
    assert parse_tool_calls(TEXTS["hermes"][4], "hermes") == (TEXTS["hermes"][4], [])
    assert parse_tool_calls(" \n", "hermes") == ("", [])
    content, calls = parse_tool_calls(TEXTS["llama3_json"][0], "llama3_json")
    assert content is None and json.loads(calls[0].arguments) == WEATHER  # "parameters" read as arguments


def test_a_call_nested_deeper_than_the_json_decoder_recurses_is_content():
    """A model may write thousands of brackets inside a call; the response keeps them as text (once a
    RecursionError, a 500)."""
    text = "<tool_call>" + "[" * 5000 + "</tool_call>"
    assert parse_tool_calls(text, "hermes") == (text, [])
    stream = ToolCallStream("hermes")
    deltas = stream.feed(text) + stream.finish()
    assert "".join(d.get("content") or "" for d in deltas) == text


@pytest.mark.parametrize("fmt,text,names", [
    ("hermes", "Sure. " + call_text("hermes", "a", {}) + '\n<tool_call>\n{"name": "cut", "arguments": {"x": [1, 2',
     ["a"]),
    ("hermes", 'Sure. <tool_call>\n{"na', []),
    ("hermes", "Sure. <tool_", []),
    ("llama3_json", 'Sure. ' + call_text("llama3_json", "a", {}) + ' {"name": "cut", "parameters": {"x"', ["a"]),
])
def test_a_call_cut_by_the_length_limit_is_neither_content_nor_a_call(fmt, text, names):
    """finish_reason length: an opened call that did not close is a call cut short. Its markup is never
    content (it leaked there beside the parsed calls), and it is no call (its arguments are not JSON);
    the complete calls before it stay. Whole text and stream agree."""
    content, calls = parse_tool_calls(text, fmt, cut=True)
    assert content == "Sure." and [c.name for c in calls] == names
    assert all(json.loads(c.arguments) == {} for c in calls)
    for seed in range(3):
        rng, stream, deltas, at = random.Random(seed), ToolCallStream(fmt), [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            deltas += stream.feed(text[at:at + step])
            at += step
        deltas += stream.finish(cut=True)
        got_content, got_calls = _reassemble(deltas)
        assert got_content == content
        assert got_calls == [{"name": c.name, "arguments": c.arguments} for c in calls]


@pytest.mark.parametrize("fmt,opener", [("hermes", '<tool_call>\n{"name": "f", "arguments": {'),
                                        ("llama3_json", '{"name": "f", "parameters": {')])
def test_a_calls_json_allows_a_bounded_run_of_whitespace(fmt, opener):
    """Indented JSON fits; a model that keeps choosing whitespace must write something else (it looped on
    tabs to max_tokens)."""
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    req = ChatCompletionRequest(messages=[], tools=[Tool(type="function", function=FunctionDefinition(
        name="f", parameters=params))], tool_choice="required")
    grammar = GrammarCompiler(smollm2_tokenizer().hf, 49152).compile(tools_constraint(req, fmt))
    bounded = xgr.GrammarMatcher(grammar)
    assert bounded.accept_string(opener + "\n" + " " * (MAX_CALL_WHITESPACE - 1))
    assert not bounded.accept_string(" ")
    indented = xgr.GrammarMatcher(grammar)
    assert indented.accept_string(opener + '\n    "city": "Paris"\n}')
