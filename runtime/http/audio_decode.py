"""Audio bytes → a mono float32 waveform at the encoder's rate (16 kHz). WAV, FLAC, MP3 and OGG
(Vorbis/Opus) are read by libsndfile 1.2 through `soundfile` (its wheel bundles the library); the
container is detected from the bytes and must be the format the request names. Resampling is a
windowed-sinc (Hann) filter, torchaudio's default `sinc_interp_hann` algorithm, in torch."""
from __future__ import annotations

import io
import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

FORMATS = ("wav", "flac", "mp3", "ogg")  # what decode() reads; the API's input_audio.format names these
CONTAINERS = {"WAV": "wav", "WAVEX": "wav", "RF64": "wav", "W64": "wav", "FLAC": "flac", "MP3": "mp3", "OGG": "ogg"}


MAX_FILTER_TAPS = 1 << 22  # 32 MiB of float64 filter taps


class AudioDecodeError(ValueError):
    """The bytes are not audio we can read (the frontend answers 400 with this message)."""


class ClipTooLong(AudioDecodeError):
    """The stream says it lasts longer than allowed (checked before decoding it)."""

    def __init__(self, seconds: float):
        super().__init__(f"the clip lasts {seconds:.1f} s")
        self.seconds = seconds


def decode(data: bytes, fmt: str, rate: int = 16000, max_seconds: Optional[float] = None) -> np.ndarray:
    """Mono float32 samples in [-1, 1] at `rate`; a stream longer than `max_seconds` is not decoded."""
    import soundfile

    if fmt not in FORMATS:
        raise AudioDecodeError(f"audio format {fmt!r} is not supported ({', '.join(FORMATS)})")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            found = CONTAINERS.get(f.format)
            if found != fmt:
                raise AudioDecodeError(f"the data is {f.format_info} audio, not {fmt}")
            if max_seconds is not None and f.samplerate > 0 and f.frames / f.samplerate > max_seconds:
                raise ClipTooLong(f.frames / f.samplerate)
            source_rate = f.samplerate
            samples = f.read(dtype="float32", always_2d=True)
    except (RuntimeError, EOFError, TypeError) as e:  # soundfile's errors are RuntimeErrors
        raise AudioDecodeError(f"the audio is not a readable {fmt} file: {e}") from None
    if samples.size == 0:
        raise AudioDecodeError("the audio has no samples")
    return resample(samples.mean(axis=1), source_rate, rate)


def resample(samples: np.ndarray, source: int, target: int, width: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """`samples` from `source` Hz to `target` Hz (windowed sinc, `width` zero crossings, Hann window)."""
    if source == target:
        return np.ascontiguousarray(samples, dtype=np.float32)
    g = math.gcd(source, target)
    orig, new = source // g, target // g
    base = min(orig, new) * rolloff
    half = math.ceil(width * orig / base)
    # one filter per output phase: a rate sharing few factors with the target (a header may say 44,101 Hz)
    # would make gigabytes of them; every common rate (8 to 192 kHz) needs under 0.3 M taps for 16 kHz
    if new * (2 * half + orig) > MAX_FILTER_TAPS:
        raise AudioDecodeError(f"a sample rate of {source} Hz cannot be resampled to {target} Hz here: use a "
                               "common rate (8, 11.025, 16, 22.05, 24, 32, 44.1, 48, 96 kHz, ...)")
    idx = torch.arange(-half, half + orig, dtype=torch.float64)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx) * base
    t = t.clamp(-width, width)
    window = torch.cos(t * math.pi / width / 2) ** 2
    t = t * math.pi
    kernels = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * (base / orig)
    x = F.pad(torch.from_numpy(np.asarray(samples, dtype=np.float64))[None, None], (half, half + orig))
    y = F.conv1d(x, kernels, stride=orig).transpose(1, 2).reshape(-1)
    return y[:math.ceil(new * len(samples) / orig)].to(torch.float32).numpy()
