"""A chat with images or clips renders through the checkpoint's own chat template, as transformers'
processors render it: the frontend gives the template image and audio parts and splices the media's
tokens where the template wrote <|image_pad|> / <|AUDIO|>. It once wrote Qwen2-VL's and Qwen2-Audio's
placeholder text itself and gave the template a string, so a checkpoint whose template writes media
otherwise (here: Qwen2-VL's numbered "Picture n:" form, a clip without "Audio n:", with odd head counts
and a non-default mrope_section) got another prompt than transformers and answered differently from the
first token, while chats without media agreed. The frontend's prompt on the worker's runner against
transformers' greedy, in one process."""
from __future__ import annotations

import base64
import io
import json
import wave
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from llaunch.runtime.encoder.in_process import InProcessAudioEmbeds
from llaunch.runtime.config import AudioConfig, VisualConfig
from llaunch.runtime.http.audio import AudioInputs
from llaunch.runtime.http.images import ImageInputs
from llaunch.runtime.http.openai_protocol import ChatCompletionRequest
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.openai_serving import OpenAIServing
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import RequestLimits
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.loader import build_audio_tower, build_model, build_vision_tower
from llaunch.runtime.models.tokenizer import load_tokenizer
from llaunch.runtime.encoder.in_process import InProcessEmbeds
from llaunch.runtime.worker.audio_rows import AudioRows
from llaunch.runtime.worker.image_rows import ImageRows
from llaunch.runtime.worker.runner import ModelRunner
from tests.fixtures.tiny_audio import AudioOracle, clip, write_tiny_qwen2_audio
from tests.fixtures.tiny_models import model_config_from_folder
from tests.fixtures.tiny_vl import TEXT_CONFIG, TOKEN_IDS, VlOracle, data_url, image_png, save_tiny_vl

from unit.test_qwen2_audio import generate as generate_audio
from unit.test_qwen2_vl import generate as generate_vl

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not

MAX_NEW = 6
# Qwen2-VL's own template with add_vision_id: each image numbered ("Picture 1: ") on its own line
VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and "
    "message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or "
    "'image_url' in content %}{% set image_count.value = image_count.value + 1 %}Picture {{ image_count.value }}: "
    "<|vision_start|><|image_pad|><|vision_end|>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a clip between its tokens alone, on a line of its own (no "Audio n:")
AUDIO_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if 'audio' in content or "
    "'audio_url' in content or content['type'] == 'input_audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def frontend(path, cfg, media) -> OpenAIServing:
    limits = RequestLimits(served_name="tiny", max_model_len=1024, vocab_size=cfg.vocab_size)
    return OpenAIServing(None, PromptTokenizer(load_tokenizer(cfg)), limits, None, media)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    text = dict(TEXT_CONFIG, hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]})
    vision = dict(depth=2, embed_dim=48, hidden_size=96, num_heads=3, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(1)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **TOKEN_IDS))
    path = save_tiny_vl(model.float(), tmp_path_factory.mktemp("tiny-qwen2-vl-own-template"))
    (path / "chat_template.jinja").write_text(VL_TEMPLATE)
    cfg = replace(model_config_from_folder(path), vision=read_checkpoint(str(path)).arch["vision"])
    llm = build_model(cfg, torch.device("cpu"), torch.float32)
    embeds = InProcessEmbeds(build_vision_tower(cfg, torch.device("cpu"), torch.float32), 2**20)
    runner = ModelRunner(llm, llm.make_kv_cache(512, 5, 512), 4, torch.device("cpu"), images=ImageRows(embeds))
    return VlOracle(path), frontend(path, cfg, ImageInputs(cfg, VisualConfig())), runner


@pytest.mark.parametrize("sizes", [[], [(90, 60)], [(60, 90), (120, 80)]], ids=["0-images", "1-image", "2-images"])
def test_images_render_through_the_checkpoints_template(vl, sizes):
    oracle, serving, runner = vl
    pngs = [image_png(w, h, 30 + seed) for seed, (w, h) in enumerate(sizes)]
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}]
    expected, prompt_len = oracle.greedy(messages, pngs, MAX_NEW)
    req = decode_body(json.dumps({"model": "tiny", "messages": messages}).encode(), ChatCompletionRequest)
    prompt, refs = serving.chat_prompt_ids(req)
    assert len(prompt) == prompt_len
    assert generate_vl(runner, prompt, refs, len(sizes), list(range(len(sizes) * 120, len(sizes) * 120 + 120))) \
        == expected


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def heard(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    path = write_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio-own-template"), seed=2)
    (path / "chat_template.jinja").write_text(AUDIO_TEMPLATE)
    ckpt = read_checkpoint(str(path))
    cfg = replace(model_config_from_folder(path), audio=ckpt.arch["audio"])
    llm = build_model(cfg, torch.device("cpu"), torch.float32)
    clips = InProcessAudioEmbeds(build_audio_tower(cfg, torch.device("cpu"), torch.float32), 2**20)
    runner = ModelRunner(llm, llm.make_kv_cache(512, 5, 512), 4, torch.device("cpu"), images=AudioRows(clips))
    return AudioOracle(path), frontend(path, cfg, AudioInputs(cfg, AudioConfig())), runner


@pytest.mark.parametrize("seconds", [[], [1.2], [0.8, 1.9]], ids=["0-clips", "1-clip", "2-clips"])
def test_clips_render_through_the_checkpoints_template(audio, seconds):
    oracle, serving, runner = audio
    wavs = [wav(clip(s, 40 + seed)) for seed, s in enumerate(seconds)]
    parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(w).decode(), "format": "wav"}}
             for w in wavs]
    text = {"type": "text", "text": "What is said?"}
    expected, prompt_len, _ = oracle.greedy([{"role": "user", "content": [*parts, text]}], [heard(w) for w in wavs],
                                            MAX_NEW)
    req = decode_body(json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [*parts, text]}]}).encode(),
                      ChatCompletionRequest)
    prompt, refs = serving.chat_prompt_ids(req)
    assert len(prompt) == prompt_len
    assert generate_audio(runner, prompt, refs, len(seconds))[0] == expected
