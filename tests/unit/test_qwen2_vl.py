"""Qwen2-VL on the worker's runner (vision tower, image embeddings spliced in, M-RoPE positions) against
transformers' generate on a tiny random checkpoint: greedy tokens identical with 0, 1 and 2 images of
different sizes, the prompt prefilled in chunks that cut through an image."""
from dataclasses import replace

import pytest
import torch

from llaunch.runtime.config import VisualConfig
from llaunch.runtime.http.images import ImageInputs
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.loader import build_model, build_vision_tower
from llaunch.runtime.encoder.in_process import InProcessEmbeds
from llaunch.runtime.worker.image_rows import ImageRows
from llaunch.runtime.worker.runner import ModelRunner
from tests.fixtures.tiny_models import model_config_from_folder
from tests.fixtures.tiny_vl import VlOracle, image_png, write_tiny_qwen2_vl

MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))
    cfg = replace(model_config_from_folder(path), vision=read_checkpoint(str(path)).arch["vision"])
    model = build_model(cfg, torch.device("cpu"), torch.float32)
    images = InProcessEmbeds(build_vision_tower(cfg, torch.device("cpu"), torch.float32), 2**20)
    runner = ModelRunner(model, model.make_kv_cache(512, 5, 512), 4, torch.device("cpu"), images=ImageRows(images))
    return VlOracle(path), ImageInputs(cfg, VisualConfig()), runner, images


def generate(runner, prompt, refs, row, slots, chunk=17):
    """Greedy tokens of one request: its prompt in chunks of `chunk` tokens, then decode steps."""
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    new = [NewSeq(row=row, request_id=f"r{row}", sampling=greedy, prompt_ids=prompt, images=refs)]
    out, step = [], 0
    for start in range(0, len(prompt), chunk):
        ids = prompt[start:start + chunk]
        last = start + len(ids) == len(prompt)
        result = runner.execute(StepPlan(step=step, new=new, prefill=[PrefillChunk(
            row=row, token_ids=ids, start=start, slots=slots[start:start + len(ids)], sample=last)]))
        new, step = [], step + 1
    out += result.token_ids
    while len(out) < MAX_NEW:
        result = runner.execute(StepPlan(step=step, decode_rows=[row], decode_slots=[slots[len(prompt) + len(out) - 1]]))
        out += result.token_ids
        step += 1
    return out


@pytest.mark.parametrize("sizes", [[], [(90, 60)], [(60, 90), (120, 80)]], ids=["0-images", "1-image", "2-images"])
def test_greedy_matches_transformers(setup, sizes):
    oracle, inputs, runner, images = setup
    pngs = [image_png(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    content = [*({"type": "image_url", "image_url": {"url": "-"}} for _ in pngs), {"type": "text", "text": "Describe."}]
    messages = [{"role": "user", "content": content}]
    expected, prompt_len = oracle.greedy(messages, pngs, MAX_NEW)
    rendered = oracle.inputs(messages, [])["input_ids"]  # one <|image_pad|> per image, as the frontend tokenizes
    prompt, refs = inputs.splice(rendered, [inputs.process(p, "image") for p in pngs])
    assert len(prompt) == prompt_len
    slots = list(range(len(sizes) * 100 + 1, len(sizes) * 100 + 1 + prompt_len + MAX_NEW))
    assert generate(runner, prompt, refs, len(sizes), slots) == expected
    if len(sizes) == 2:  # a grid of different height and width: positions after it are M-RoPE's
        assert refs[0].grid != refs[1].grid
        assert images.encoded >= 2


def test_repeated_image_is_not_encoded_again(setup):
    oracle, inputs, runner, images = setup
    png = image_png(90, 60, 7)
    rendered = oracle.inputs([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "-"}}]}],
                             [])["input_ids"]
    prompt, refs = inputs.splice(rendered, [inputs.process(png, "image")])
    before, hits = images.encoded, images.cache.hits
    first = generate(runner, prompt, refs, 3, list(range(400, 400 + len(prompt) + MAX_NEW)))
    second = generate(runner, prompt, refs, 3, list(range(400, 400 + len(prompt) + MAX_NEW)))
    assert first == second
    assert images.encoded == before + 1 and images.cache.hits == hits + 1
