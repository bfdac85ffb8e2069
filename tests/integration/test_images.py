"""Qwen2-VL through the real HTTP API with the openai client: greedy chat answers token-identical to
transformers' generate with 0, 1 and 2 images of different sizes; image tokens counted in usage; a
repeated image shares the prompt cache and is not encoded again; bad images are 400s."""
from __future__ import annotations

import base64

import openai
import pytest
from openai import OpenAI

from fixtures.tiny_vl import VlOracle, data_url, image_png, write_tiny_qwen2_vl
from integration.conftest import start_server

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
    first, second = ask(client, [png], "Once."), ask(client, [png], "Twice.")
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
