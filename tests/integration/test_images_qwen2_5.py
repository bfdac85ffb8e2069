"""Qwen2.5-VL through the real HTTP API with the openai client: greedy chat answers token-identical to
transformers' generate with 0, 1 and 2 images of different sizes (merged grids odd in a side: windows cut
short at the edge), its window-attention vision tower split over two visual processes (visual.tp=2, gloo
on CPU; the unsplit tower is checked against transformers' in tests/unit/test_qwen2_5_vl.py)."""
from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from fixtures.tiny_vl import image_png
from fixtures.tiny_vl25 import Vl25Oracle, write_tiny_qwen2_5_vl
from integration.conftest import start_server
from integration.test_images import ask, assert_greedy_matches


@pytest.fixture(scope="module")
def vl25(tmp_path_factory):
    path = write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"))
    with start_server(tmp_path_factory, "tiny-qwen2.5-vl", ["model=qwen2.5-vl", f"model.path={path}",
                                                             "model.name=tiny-vl", "visual.tp=2",
                                                             "visual.max_images_per_request=2"]) as server:
        yield server, Vl25Oracle(path), OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("sizes", [[], [(90, 60)], [(60, 90), (250, 170)]], ids=["0-images", "1-image", "2-images"])
def test_greedy_matches_transformers(vl25, sizes):
    assert "visual.0.1" in vl25[0].output()  # the tower's second rank is part of the graph
    assert_greedy_matches(vl25, sizes)


def test_video_parts_are_400(vl25):
    server, oracle, client = vl25
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": [video]}])
    assert "video_url" in e.value.body["message"]
    assert ask(client, [image_png(60, 60, 3)]).choices[0].message.content is not None  # still serving
