"""Audio bytes → a mono float32 waveform at the encoder's rate (16 kHz). WAV (PCM, 8/16/24/32-bit) is
read by the standard library; FLAC and MP3 need a decoding library that the environment does not have
yet (PyAV, which bundles FFmpeg, is the plan) and are refused with a clear error.
Resampling is a windowed-sinc (Hann) filter, torchaudio's default `sinc_interp_hann` algorithm, in torch."""
from __future__ import annotations

import io
import math
import wave

import numpy as np
import torch
import torch.nn.functional as F

FORMATS = ("wav",)  # what decode() reads; the API's input_audio.format names these


class AudioDecodeError(ValueError):
    """The bytes are not audio we can read (the frontend answers 400 with this message)."""


def decode(data: bytes, fmt: str, rate: int = 16000) -> np.ndarray:
    """Mono float32 samples in [-1, 1] at `rate`."""
    if fmt not in FORMATS:
        raise AudioDecodeError(f"audio format {fmt!r} is not supported ({', '.join(FORMATS)})")
    try:
        with wave.open(io.BytesIO(data)) as w:
            channels, width, source_rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError, ValueError) as e:
        raise AudioDecodeError(f"the audio is not a readable PCM WAV file: {e}") from None
    if width == 1:
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    elif width in (2, 4):
        kind = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, kind).astype(np.float32) / -float(np.iinfo(kind).min)
    elif width == 3:  # little-endian 24-bit: sign-extend into int32
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        samples = ((b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16) << 8 >> 8).astype(np.float32) / 2**23
    else:
        raise AudioDecodeError(f"{8 * width}-bit WAV samples are not supported")
    if samples.size == 0:
        raise AudioDecodeError("the audio has no samples")
    mono = samples[:samples.size // channels * channels].reshape(-1, channels).mean(axis=1)
    return resample(mono, source_rate, rate)


def resample(samples: np.ndarray, source: int, target: int, width: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """`samples` from `source` Hz to `target` Hz (windowed sinc, `width` zero crossings, Hann window)."""
    if source == target:
        return np.ascontiguousarray(samples, dtype=np.float32)
    g = math.gcd(source, target)
    orig, new = source // g, target // g
    base = min(orig, new) * rolloff
    half = math.ceil(width * orig / base)
    idx = torch.arange(-half, half + orig, dtype=torch.float64)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx) * base
    t = t.clamp(-width, width)
    window = torch.cos(t * math.pi / width / 2) ** 2
    t = t * math.pi
    kernels = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * (base / orig)
    x = F.pad(torch.from_numpy(np.asarray(samples, dtype=np.float64))[None, None], (half, half + orig))
    y = F.conv1d(x, kernels, stride=orig).transpose(1, 2).reshape(-1)
    return y[:math.ceil(new * len(samples) / orig)].to(torch.float32).numpy()
