"""A thinking model's answer through the whole graph with Qwen3's real chat template (server.chat_template, from
llama.cpp's templates: scripts/prepare_tokenizers.py) and server.reasoning_parser=qwen3, on a tiny Qwen2 checkpoint
(float32, CPU). The random model is held to a <think>…</think> answer by a regex; the same prompt through
/v1/completions (which no reasoning parser touches) gives the raw answer, whose block must come back as
message.reasoning_content and the rest as content, whole and streamed. enable_thinking=false
(chat_template_kwargs) renders the template's empty block into the prompt."""
from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from fixtures.tiny_models import models_dir
from integration.conftest import start_server

MODEL = "tiny-qwen2"
QWEN3_TEMPLATE = models_dir() / "chat-templates" / "Qwen-Qwen3-0.6B.jinja"
ANSWER = r"<think>[a-z ]{4,24}</think>\n\n[a-z ]{4,24}"
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs):
    assert QWEN3_TEMPLATE.is_file(), "run `make setup` (scripts/prepare_tokenizers.py) first"
    with start_server(tmp_path_factory, "reasoning", [
            "model=qwen2", f"model.path={tiny_dirs['qwen2']}", f"model.name={MODEL}",
            f"server.chat_template={QWEN3_TEMPLATE}", "server.reasoning_parser=qwen3"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def prompt_ids(server, **template_kwargs) -> list[int]:
    body = {"model": MODEL, "messages": MESSAGES, **({"chat_template_kwargs": template_kwargs} if template_kwargs else {})}
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def raw(server, client) -> re.Match:
    """The answer as the model writes it, split by the regex it was held to."""
    out = client.completions.create(model=MODEL, prompt=prompt_ids(server), max_tokens=80, temperature=0,
                                    extra_body={"guided_regex": ANSWER})
    match = re.fullmatch(r"<think>(.*)</think>(.*)", out.choices[0].text, re.S)
    assert match, out.choices[0].text
    return match


def test_the_think_block_is_reasoning_content(client, raw):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                         extra_body={"guided_regex": ANSWER})
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == (raw[1], raw[2])


def test_streamed_deltas_split_the_same_way(client, raw):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                            stream=True, extra_body={"guided_regex": ANSWER})
    thought, content = [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        thought.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
    assert ("".join(thought), "".join(content)) == (raw[1], raw[2])


def test_include_reasoning_false_drops_it(client, raw):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                         extra_body={"guided_regex": ANSWER, "include_reasoning": False})
    message = out.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content == raw[2]


def test_enable_thinking_false_renders_the_empty_block(server, client):
    thinking, plain = prompt_ids(server), prompt_ids(server, enable_thinking=False)
    text = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": plain}, timeout=60).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert plain[:len(thinking)] == thinking and len(plain) > len(thinking)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.usage.prompt_tokens == len(plain)
