"""Qwen2-Audio through the real HTTP API with the openai client: greedy chat answers token-identical to
transformers' generate with 0, 1 and 2 clips (base64 WAV input_audio parts, and a data: audio_url);
clip tokens counted in usage; the audio server audio.0 runs with the audio.* keys; a repeated clip is an
embed-cache hit and not encoded again; a FLAC clip answers as transformers does and as the same clip in WAV (which
then hits the embed cache: the same waveform); bad, corrupt, mislabelled, too long, too large and too
many clips are 400s."""
from __future__ import annotations

import base64
import io
import wave

import numpy as np
import openai
import pytest
from openai import OpenAI

from fixtures.tiny_audio import AudioOracle, clip, write_tiny_qwen2_audio
from integration.conftest import start_server
from integration.test_prompt_cache import settled, wait_for

MAX_NEW = 6


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    path = write_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio"))
    with start_server(tmp_path_factory, "tiny-qwen2-audio", [
            "model=qwen2", f"model.path={path}", "model.name=tiny-audio", "audio.max_clips_per_request=2",
            "audio.max_clip_seconds=3", "audio.max_clip_bytes=200000", "audio.batch_size=2",
            "audio.embed_cache_mib=16"]) as server:
        yield server, AudioOracle(path), OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    """16-bit PCM mono WAV bytes."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def flac(samples: np.ndarray, rate: int = 16000) -> bytes:
    """The same 16-bit samples as wav() writes, FLAC-compressed."""
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, (np.clip(samples, -1, 1) * 32767).astype("<i2"), rate, format="FLAC", subtype="PCM_16")
    return out.getvalue()


def heard(data: bytes) -> np.ndarray:
    """The waveform a WAV's 16-bit samples stand for (what the oracle is given)."""
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def ask(client, parts, text="What is it?"):
    return client.chat.completions.create(
        model="tiny-audio", messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.mark.parametrize("seconds", [[], [1.0], [0.6, 2.5]], ids=["0-clips", "1-clip", "2-clips"])
def test_greedy_matches_transformers(audio, seconds):
    server, oracle, client = audio
    wavs = [wav(clip(s, 20 + seed)) for seed, s in enumerate(seconds)]
    parts = [input_audio(w) for w in wavs]
    if len(parts) == 2:  # the second as a data: audio_url
        parts[1] = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(wavs[1]).decode()}}
    messages = [{"role": "user", "content": [*({"type": "input_audio"} for _ in wavs), {"type": "text", "text": "What is it?"}]}]
    expected, prompt_len, _ = oracle.greedy(messages, [heard(w) for w in wavs], MAX_NEW)
    answer = ask(client, parts)
    assert answer.choices[0].model_extra["token_ids"] == expected
    assert answer.usage.prompt_tokens == prompt_len  # clip tokens included


def test_the_audio_server_runs_with_the_audio_keys(audio):
    """The clips' encoder process is audio.0, started with audio.batch_size and audio.embed_cache_mib."""
    server, _, _ = audio
    ready = [line for line in server.output().splitlines() if "ready" in line and " audio.0 " in line]
    assert ready and "cache_mib=16" in ready[0] and "batch=2" in ready[0], server.output()[-2000:]
    assert " visual.0 " not in server.output()


def test_repeated_clip_hits_the_embed_cache(audio):
    server, oracle, client = audio
    data = wav(clip(1.5, 42))
    before = settled(server)
    first, second = ask(client, [input_audio(data)], "Once."), ask(client, [input_audio(data)], "Twice.")
    m = wait_for(server, lambda m: m["mm_cache_queries_total"] >= before["mm_cache_queries_total"] + 2, "2 lookups")
    assert m["mm_cache_hits_total"] == before["mm_cache_hits_total"] + 1  # the second found the first's
    assert m["images_encoded_total"] == before["images_encoded_total"] + 1  # and it was not encoded again
    other = ask(client, [input_audio(wav(clip(1.5, 43)))], "Once.")
    # the second shares the clip's KV (its prefix up to the text); a different clip shares only the text before it
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) > (other.usage.prompt_tokens_details.cached_tokens or 0)
    assert first.choices[0].model_extra["token_ids"] != other.choices[0].model_extra["token_ids"]


def test_flac_answers_as_the_same_wav(audio):
    server, oracle, client = audio
    samples = clip(1.2, 60)
    messages = [{"role": "user", "content": [{"type": "input_audio"}, {"type": "text", "text": "What is it?"}]}]
    expected, _, _ = oracle.greedy(messages, [heard(wav(samples))], MAX_NEW)
    before = settled(server)
    from_flac = ask(client, [input_audio(flac(samples), "flac")])
    from_wav = ask(client, [input_audio(wav(samples))])
    assert from_flac.choices[0].model_extra["token_ids"] == expected == from_wav.choices[0].model_extra["token_ids"]
    m = wait_for(server, lambda m: m["mm_cache_queries_total"] >= before["mm_cache_queries_total"] + 2, "2 lookups")
    assert m["mm_cache_hits_total"] == before["mm_cache_hits_total"] + 1  # the WAV's features are the FLAC's


@pytest.mark.parametrize("part, why", [
    (input_audio(wav(clip(0.5, 1)), "aac"), "not supported (wav, flac, mp3, ogg)"),
    (input_audio(wav(clip(0.5, 1)), "mp3"), "not mp3"),
    (input_audio(flac(clip(1.0, 6))[:3000], "flac"), "cannot be read"),
    (input_audio(b"RIFF not really a wave file"), "cannot be read"),
    ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "base64"),
    ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "not fetched"),
    (input_audio(wav(clip(4.0, 2))), "max_clip_seconds"),
    (input_audio(wav(clip(2.5, 3, rate=48000), rate=48000)), "max_clip_bytes"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "only text content parts"),
    # no encoder output: it failed the audio server's whole batch and, cached as no blocks, killed the worker
    (input_audio(wav(clip(0.01, 7))), "too short"),
])
def test_bad_clips_are_400(audio, part, why):
    server, oracle, client = audio
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-audio", max_tokens=2, messages=[{"role": "user", "content": [part]}])
    assert why in e.value.body["message"]


def test_too_many_clips_are_400(audio):
    server, oracle, client = audio
    part = input_audio(wav(clip(0.5, 5)))
    with pytest.raises(openai.BadRequestError, match="max_clips_per_request"):
        client.chat.completions.create(model="tiny-audio", max_tokens=2, messages=[{"role": "user", "content": [part] * 3}])
    assert ask(client, [part]).choices[0].message.content is not None  # still serving
