"""Images and audio clips in the serving benchmark (multimodal models: Qwen2-VL, Qwen2-Audio): each
request is a streaming /v1/chat/completions with --images-per-request images of --image-size x
--image-size pixels as data: URLs (PNG), or --audio-per-request clips of --audio-seconds as input_audio
parts (16-bit mono WAV at --audio-rate), before a text of --input-len random words; --repeat-images /
--repeat-audio sends the same media with every request (the embed cache's case: encoded once), else
every request's media are new. The server's `<prefix>:images_encoded_total` and
`mm_cache_{queries,hits}_total` (clips are counted there too: the visual servers encode them) over the
measured run give media encoded per second and the embed cache's hit rate.

TTFT counts from the first chunk with content (the role-only opening chunk is not a token); the
input tokens reported are the text's words (the images' tokens are not counted client-side)."""
from __future__ import annotations

import base64
import io
import json
import wave
from typing import Optional

import numpy as np

from bench_workload import series_totals

IMAGE_SERIES = ("images_encoded", "mm_cache_queries", "mm_cache_hits")
_requests = [0]  # chat requests made so far: request n's media come from seeds of n
_urls: dict[tuple[int, int], str] = {}
_clips: dict[tuple[float, int, int], str] = {}


def add_args(ap) -> None:
    ap.add_argument("--images-per-request", type=int, default=0,
                    help="> 0: chat completions with this many images per request (a multimodal model)")
    ap.add_argument("--image-size", type=int, default=1024, help="each image's width and height, pixels")
    ap.add_argument("--repeat-images", action="store_true",
                    help="every request sends the same image(s): the embed cache's case (else all new)")
    ap.add_argument("--audio-per-request", type=int, default=0,
                    help="> 0: chat completions with this many input_audio clips per request (an audio model)")
    ap.add_argument("--audio-seconds", type=float, default=30.0, help="each clip's duration, seconds")
    ap.add_argument("--audio-rate", type=int, default=16000, help="each clip's sample rate (the server resamples to 16 kHz)")
    ap.add_argument("--repeat-audio", action="store_true",
                    help="every request sends the same clip(s): the embed cache's case (else all new)")


def is_chat(args) -> bool:
    """Requests carry images or clips: chat completions through this module."""
    return bool(args.images_per_request or args.audio_per_request)


def image_url(size: int, seed: int, keep: bool = True) -> str:
    """A size x size PNG as a data: URL, its pixels fixed by `seed` (smooth: small, yet distinct per seed);
    `keep` False: the last use of it (a new image is sent once), so it leaves the store."""
    key = (size, seed)
    if key not in _urls:
        from PIL import Image

        rng = np.random.default_rng(seed)
        a, b, c = rng.integers(1, 255, size=(3, 3))
        y, x = np.mgrid[0:size, 0:size]
        pixels = np.stack([(x * a[i] // 7 + y * b[i] // 5 + c[i]) % 256 for i in range(3)], -1).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        _urls[key] = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return _urls[key] if keep else _urls.pop(key)


def wav_clip(seconds: float, rate: int, seed: int, keep: bool = True) -> str:
    """A 16-bit mono WAV of a chirp plus noise fixed by `seed` (distinct per seed), base64; `keep` as
    image_url's."""
    key = (seconds, rate, seed)
    if key not in _clips:
        rng = np.random.default_rng(seed)
        t = np.arange(int(seconds * rate)) / rate
        f0, f1 = rng.uniform(100, 600), rng.uniform(800, min(6000, rate / 2 - 500))
        wave_ = 0.4 * np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t ** 2 / (2 * seconds))) + 0.05 * rng.standard_normal(t.shape)
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
            w.writeframes((np.clip(wave_, -1, 1) * 32767).astype("<i2").tobytes())
        _clips[key] = base64.b64encode(buf.getvalue()).decode()
    return _clips[key] if keep else _clips.pop(key)


def pregenerate(args, requests: int) -> None:
    """Encode the images and clips of the next `requests` chat requests now. Made while sending, each new
    1,024 px PNG (50-350 ms of client CPU) held the client's event loop and every stream with it: the
    H200 run of 2026-12-02 measured 1.5 images/s that way, a figure of the client, not of the server."""
    for n in range(_requests[0], _requests[0] + requests):
        for s in media_seeds(args, args.images_per_request, args.repeat_images, n):
            image_url(args.image_size, 1000 + s)
        for s in media_seeds(args, args.audio_per_request, args.repeat_audio, n):
            wav_clip(args.audio_seconds, args.audio_rate, s)


def media_seeds(args, count: int, repeat: bool, n: int) -> list[int]:
    """The seeds of request number `n`'s `count` images (or clips): new ones per request unless `repeat`."""
    first = 10**6 if repeat else n * count  # repeated ones are never new ones
    return [args.seed * 10**7 + first + k for k in range(count)]


def chat_payload(args, prompt: list[int], max_tokens: int) -> dict:
    words = " ".join(f"w{t}" for t in prompt)
    n = _requests[0]  # this request's media (pregenerate made them for the same numbers)
    _requests[0] += 1
    content = [{"type": "image_url", "image_url": {"url": image_url(args.image_size, 1000 + s, args.repeat_images)}}
               for s in media_seeds(args, args.images_per_request, args.repeat_images, n)]
    content += [{"type": "input_audio", "input_audio": {
                    "data": wav_clip(args.audio_seconds, args.audio_rate, s, args.repeat_audio), "format": "wav"}}
                for s in media_seeds(args, args.audio_per_request, args.repeat_audio, n)]
    return {"model": args.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": content + [{"type": "text", "text": words}]}]}


def is_opening(line: str) -> bool:
    """The role-only first chunk of a chat stream (no token yet)."""
    line = line.strip()
    if not line.startswith("data:") or line.endswith("[DONE]"):
        return False
    try:
        choices = json.loads(line[len("data:"):]).get("choices") or []
    except ValueError:
        return False
    return bool(choices) and all(not (c.get("delta") or {}).get("content") and c.get("finish_reason") is None
                                 and "role" in (c.get("delta") or {}) for c in choices)


def image_counts(metrics_text: str) -> Optional[tuple[float, float, float]]:
    """(images encoded, embed cache queries, hits) summed over series; None when not exposed."""
    return series_totals(metrics_text, IMAGE_SERIES)


def image_result(before, after, duration: float, media: str = "images") -> dict[str, float]:
    """`media`: what the encode counter counted in this run (images, or an audio model's clips)."""
    if before is None or after is None:
        return {}
    encoded, queries, hits = (a - b for a, b in zip(after, before))
    return {"images_encoded": encoded, "images_encoded_per_s": encoded / duration if duration > 0 else 0.0,
            "mm_cache_queries": queries, "mm_cache_hits": hits,
            "mm_cache_hit_rate": hits / queries if queries else 0.0, "media": media}


def image_rows(result: dict) -> list[tuple[str, object, str]]:
    if "images_encoded" not in result:
        return []
    media = result.get("media", "images").capitalize()
    return [(f"{media} encoded", result["images_encoded"], ".0f"),
            (f"{media} encoded per second", result["images_encoded_per_s"], ".2f"),
            ("Embed cache hit rate (%)", 100 * result["mm_cache_hit_rate"], ".2f")]
