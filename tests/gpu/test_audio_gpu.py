"""Qwen2-Audio served on a GPU end to end: a tiny random checkpoint (written by the test) served with
device=cuda in float32 (the visual server encodes the clip with the audio tower on the GPU into the
shared-memory embed cache, the worker splices it in with the Triton kernels and CUDA graphs); a chat
request with one clip (a FLAC input_audio part) answers with transformers' greedy tokens and logprobs
(transformers in float32 on the CPU), and the same clip again is an embed-cache hit."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest

from fixtures.tiny_audio import AudioOracle, clip, write_tiny_qwen2_audio
from integration.server import LlaunchServer
from integration.test_prompt_cache import settled, wait_for

MAX_NEW = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio"))
    run_dir = tmp_path_factory.mktemp("run-audio-gpu")
    with LlaunchServer(["device=cuda", "model.dtype=float32", "model=qwen2", f"model.path={path}",
                        "model.name=tiny-audio", "cache.max_total_tokens=16384", "router.max_running_requests=16"],
                       run_dir=run_dir) as server:
        yield server, AudioOracle(path)


def flac_part(samples: np.ndarray) -> tuple[dict, np.ndarray]:
    """An input_audio part (16-bit FLAC at 16 kHz) and the waveform its samples stand for."""
    import soundfile

    ints = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    out = io.BytesIO()
    soundfile.write(out, ints, 16000, format="FLAC", subtype="PCM_16")
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(out.getvalue()).decode(), "format": "flac"}}
    return part, ints.astype(np.float32) / 32768


def chat(server, part: dict) -> dict:
    body = {"model": "tiny-audio", "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "return_token_ids": True,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_clip_greedy_matches_transformers(served):
    server, oracle = served
    part, heard = flac_part(clip(2.3, 11))
    messages = [{"role": "user", "content": [{"type": "input_audio"}, {"type": "text", "text": "What is it?"}]}]
    expected, prompt_len, expected_logprobs = oracle.greedy(messages, [heard], MAX_NEW)
    answer = chat(server, part)
    choice = answer["choices"][0]
    assert choice["token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == prompt_len  # the clip's tokens included
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == pytest.approx(expected_logprobs, abs=5e-3)
    before = settled(server)
    assert chat(server, part)["choices"][0]["token_ids"] == expected
    m = wait_for(server, lambda m: m["mm_cache_queries_total"] >= before["mm_cache_queries_total"] + 1, "a lookup")
    assert m["mm_cache_hits_total"] == before["mm_cache_hits_total"] + 1  # found, not encoded again
    assert m["images_encoded_total"] == before["images_encoded_total"]
