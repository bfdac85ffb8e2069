"""Qwen2-VL through the real HTTP API with the openai client: greedy chat answers token-identical to
transformers' generate with 0, 1 and 2 images of different sizes; image tokens counted in usage; a
repeated image shares the prompt cache and is not encoded again (the embed cache's metrics); bad images
are 400s; the visual server's death takes the graph down."""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from fixtures.tiny_vl import VlOracle, data_url, image_png, write_tiny_qwen2_vl
from integration.conftest import start_server
from integration.test_host_tier import SHM, running
from integration.test_prompt_cache import settled, wait_for

MAX_NEW = 6


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = write_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))
    with start_server(tmp_path_factory, "tiny-qwen2-vl", ["model=qwen2-vl", f"model.path={path}", "model.name=tiny-vl",
                                                           "visual.max_images_per_request=2",
                                                           "visual.max_image_pixels=40000"]) as server:
        yield server, VlOracle(path), OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def ask(client, pngs, text="Describe."):
    content = [*({"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs), {"type": "text", "text": text}]
    return client.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True,
                                                                                         "return_token_ids": True})


@pytest.mark.parametrize("sizes", [[], [(90, 60)], [(60, 90), (120, 80)]], ids=["0-images", "1-image", "2-images"])
def test_greedy_matches_transformers(vl, sizes):
    assert_greedy_matches(vl, sizes)


def assert_greedy_matches(vl, sizes: list[tuple[int, int]]) -> None:
    """A chat with one image of each size, then text: the same tokens as transformers' greedy."""
    server, oracle, client = vl
    pngs = [image_png(w, h, 10 + seed) for seed, (w, h) in enumerate(sizes)]
    oracle_content = [*({"type": "image_url", "image_url": {"url": "-"}} for _ in pngs), {"type": "text", "text": "Describe."}]
    expected, prompt_len = oracle.greedy([{"role": "user", "content": oracle_content}], pngs, MAX_NEW)
    answer = ask(client, pngs)
    assert answer.choices[0].model_extra["token_ids"] == expected
    assert answer.usage.prompt_tokens == prompt_len  # image tokens included


def test_repeated_image_hits_the_caches(vl):
    server, oracle, client = vl
    png = image_png(100, 70, 42)
    before = settled(server)
    first, second = ask(client, [png], "Once."), ask(client, [png], "Twice.")
    m = wait_for(server, lambda m: m["mm_cache_queries_total"] >= before["mm_cache_queries_total"] + 2, "2 lookups")
    assert m["mm_cache_hits_total"] == before["mm_cache_hits_total"] + 1  # the second found the first's
    assert m["images_encoded_total"] == before["images_encoded_total"] + 1  # and it was not encoded again
    other = ask(client, [image_png(100, 70, 43)], "Once.")
    # the second shares the image's KV (its prefix up to the text); a different image shares only the text before it
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) > (other.usage.prompt_tokens_details.cached_tokens or 0)
    assert first.choices[0].model_extra["token_ids"] != other.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("url, why", [
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "cannot be read"),
    ("data:image/png;base64,%%%", "base64"),
    ("https://example.com/cat.png", "not fetched"),
    ("file:///etc/hostname", "Local image files are refused"),
    (data_url(image_png(300, 200, 1)), "max_image_pixels"),
])
def test_bad_images_are_400(vl, url, why):
    server, oracle, client = vl
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}])
    assert why in e.value.body["message"]


def test_too_many_images_and_unsupported_detail_are_400(vl):
    server, oracle, client = vl
    part = {"type": "image_url", "image_url": {"url": data_url(image_png(60, 60, 3))}}
    with pytest.raises(openai.BadRequestError, match="max_images_per_request"):
        client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": [part] * 3}])
    low = {"type": "image_url", "image_url": {"url": part["image_url"]["url"], "detail": "low"}}
    with pytest.raises(openai.BadRequestError, match="detail"):
        client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": [low]}])
    assert ask(client, [image_png(60, 60, 3)]).choices[0].message.content is not None  # still serving


def generate(server, text: str, images: list[dict], route: str = "/generate") -> httpx.Response:
    """LightLLM's /generate (or /generate_stream) with its multimodal_params."""
    return httpx.post(server.url + route, timeout=60, json={
        "inputs": text, "parameters": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "return_details": True},
        "multimodal_params": {"images": images}})


def test_generate_with_images_matches_transformers(vl):
    """The prompt places images as LightLLM's Qwen2-VL tokenizer reads them: <|vision_start|><|image_pad|>
    <|vision_end|>, or <|vision_start|><|vision_end|>; an image as base64 or as a data: URL."""
    server, oracle, client = vl
    pngs = [image_png(90, 60, 10), image_png(60, 90, 11)]
    content = [{"type": "image_url", "image_url": {"url": "-"}}, {"type": "text", "text": "Describe."}]
    messages = [{"role": "user", "content": content}]
    text = oracle.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected, prompt_len = oracle.greedy(messages, pngs[:1], MAX_NEW)
    r = generate(server, text, [{"type": "base64", "data": base64.b64encode(pngs[0]).decode()}])
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["tokens"]] == expected
    assert r.json()["prompt_tokens"] == prompt_len  # image tokens included
    stream = generate(server, text, [{"type": "base64", "data": base64.b64encode(pngs[0]).decode()}], "/generate_stream")
    events = [json.loads(line[5:]) for line in stream.text.splitlines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in events if e["token"]["id"] is not None] == expected
    two = [{"role": "user", "content": [content[0], content[0], content[1]]}]
    expected_two, _ = oracle.greedy(two, pngs, MAX_NEW)
    short = oracle.tokenizer.apply_chat_template(two, add_generation_prompt=True, tokenize=False).replace(
        "<|image_pad|>", "")
    r = generate(server, short, [{"type": "url", "data": data_url(pngs[0])},
                                 {"type": "base64", "data": base64.b64encode(pngs[1]).decode()}])
    assert r.status_code == 200, r.text
    assert [t["id"] for t in r.json()["tokens"]] == expected_two


def test_responses_and_anthropic_messages_take_images(vl):
    """An image as a Responses input_image part and as an Anthropic base64 image block: the prompt (image
    tokens counted) and the greedy answer of the chat path, which equals transformers'."""
    server, oracle, client = vl
    png = image_png(90, 60, 7)
    _, prompt_len = oracle.greedy([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "-"}},
                                                                {"type": "text", "text": "Describe."}]}], [png], 1)
    chat = client.chat.completions.create(model="tiny-vl", max_tokens=MAX_NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                     {"type": "text", "text": "Describe."}]}])
    out = client.responses.create(model="tiny-vl", max_output_tokens=MAX_NEW, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(png)},
                                     {"type": "input_text", "text": "Describe."}]}])
    assert out.output_text == chat.choices[0].message.content and out.usage.input_tokens == prompt_len
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png).decode()}}
    message = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0).messages.create(
        model="tiny-vl", max_tokens=MAX_NEW, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "Describe."}]}])
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt_len


def test_generate_bad_images_are_400(vl):
    server, oracle, client = vl
    good = {"type": "base64", "data": base64.b64encode(image_png(60, 60, 3)).decode()}
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>Describe."
    cases = [
        ([{"type": "image_size", "data": [60, 60]}], "multimodal_params.images[0].type", "not supported"),
        ([{"type": "base64", "data": "%%%"}], "multimodal_params.images[0].data", "base64"),
        ([{"type": "base64", "data": base64.b64encode(b"not an image").decode()}], "multimodal_params.images[0]",
         "cannot be read"),
        ([{"type": "url", "data": "https://example.com/cat.png"}], "multimodal_params.images[0].data", "not fetched"),
        ([{"type": "url", "data": "/etc/hostname"}], "multimodal_params.images[0].data", "Local image files"),
        ([good] * 3, "multimodal_params.images", "max_images_per_request"),
        ([good, good], "inputs", "placeholders"),  # one placeholder for two images
    ]
    for images, param, why in cases:
        r = generate(server, placeholder, images)
        assert r.status_code == 400, (images, r.text)
        assert r.json()["error"]["param"] == param and why in r.json()["error"]["message"], r.text
    # token ids past the vocabulary are what images become: a client's own are refused, not spliced
    ids = oracle.tokenizer(placeholder)["input_ids"] + [10**8]
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "inputs": ids, "parameters": {"max_new_tokens": MAX_NEW}, "multimodal_params": {"images": [good]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "inputs", r.text
    assert "outside the vocabulary" in r.json()["error"]["message"], r.text
    r = generate(server, placeholder, [{**good, "uuid": 1}])  # a field no API defines: served without it
    assert r.status_code == 200 and r.headers["X-Ignored-Fields"] == "multimodal_params.images[0].uuid"


@pytest.mark.parametrize("repeat", [True, False], ids=["repeated", "new"])
def test_bench_serving_with_images_reports_images_encoded(vl, tmp_path, repeat):
    server, oracle, client = vl
    out = tmp_path / "bench.json"
    bench = subprocess.run(
        [sys.executable, "scripts/bench_serving.py", "--base-url", server.url, "--model", "tiny-vl", "--num-prompts", "4",
         "--input-len", "5", "--output-len", "3", "--concurrency", "2", "--warmup", "1", "--images-per-request", "1",
         "--image-size", "56", "--result-file", str(out)] + ["--repeat-images"] * repeat,
        capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0 and result["total_output_tokens"] == 12
    # repeated: the warm-up encoded the one image, the measured requests hit; new: each is encoded (the
    # router's stats trail the answers a little, so the window may gain the warm-up or lose the last one)
    if repeat:
        assert result["images_encoded"] <= 1 and result["mm_cache_hits"] >= 3
    else:
        assert result["images_encoded"] >= 3 and result["mm_cache_hits"] == 0
    assert "Images encoded per second" in bench.stdout


def test_the_graph_goes_down_when_the_visual_server_dies(vl):
    """Last in the module: SIGKILL the visual server; llaunch exits non-zero naming it, leaves no
    process behind, and removes the embed cache's file."""
    server, oracle, client = vl
    embeds = [p for p in os.listdir(SHM) if p.startswith("llaunch-embeds-")]
    [visual] = [pid for pid in server.children() if b"llaunch.runtime.encoder.process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    graph = server.children()
    os.kill(visual, signal.SIGKILL)
    assert server.proc.wait(60) != 0
    assert "visual.0" in server.output()
    assert not [pid for pid in graph if running(pid)]
    assert embeds and not set(embeds) & set(os.listdir(SHM))


def test_visual_tp2_gives_the_greedy_answer_of_transformers(vl, tmp_path_factory):
    """visual.tp=2: the vision tower split over visual.0 and its follower visual.0.1 (gloo on CPU)."""
    _, oracle, _ = vl
    png = image_png(90, 60, 12)
    content = [{"type": "image_url", "image_url": {"url": "-"}}, {"type": "text", "text": "Describe."}]
    expected, _ = oracle.greedy([{"role": "user", "content": content}], [png], MAX_NEW)
    with start_server(tmp_path_factory, "tiny-qwen2-vl-tp2", ["model=qwen2-vl", f"model.path={oracle.path}",
                                                               "model.name=tiny-vl", "visual.tp=2"]) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert "visual.0.1" in server.output()  # its follower is part of the graph
        assert ask(client, [png]).choices[0].model_extra["token_ids"] == expected
        assert ask(client, [image_png(60, 90, 13)]).choices[0].model_extra["token_ids"]  # a second batch
