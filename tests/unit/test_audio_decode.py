"""Decoding clips for Qwen2-Audio: PCM WAV at other rates and channel counts comes out as mono 16 kHz
(a resampled tone equals the tone sampled at 16 kHz); what we cannot read is an AudioDecodeError."""
import io
import wave

import numpy as np
import pytest

from llaunch.runtime.audio.decode import AudioDecodeError, decode


def wav_bytes(samples: np.ndarray, rate: int, width: int) -> bytes:
    """`samples` [frames, channels] in [-1, 1] as a PCM WAV file."""
    if width == 1:
        raw = (samples * 127 + 128).round().astype(np.uint8).tobytes()
    elif width == 3:
        ints = (samples * (2**23 - 1)).round().astype(np.int32)
        raw = np.stack([ints & 255, ints >> 8 & 255, ints >> 16 & 255], -1).astype(np.uint8).tobytes()
    else:
        kind = np.int16 if width == 2 else np.int32
        raw = (samples * np.iinfo(kind).max).round().astype(kind).tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return out.getvalue()


def tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * hz * np.arange(int(rate * seconds)) / rate)


@pytest.mark.parametrize("rate,channels,width", [(16000, 1, 2), (44100, 2, 2), (22050, 1, 3), (8000, 1, 1),
                                                 (48000, 2, 4)])
def test_wav_becomes_mono_16k(rate, channels, width):
    samples = np.repeat(tone(rate, 0.5)[:, None], channels, axis=1)
    out = decode(wav_bytes(samples, rate, width), "wav")
    expected = tone(16000, 0.5)
    assert out.dtype == np.float32 and len(out) == len(expected)
    inner = slice(200, -200)  # the filter's edges see the silence outside the clip
    assert np.abs(out[inner] - expected[inner]).max() < (2e-2 if width == 1 else 2e-3)


@pytest.mark.parametrize("data,fmt", [(b"RIFF....WAVEjunk", "wav"), (b"", "wav"), (b"ID3\x03", "mp3")])
def test_unreadable_audio_is_refused(data, fmt):
    with pytest.raises(AudioDecodeError):
        decode(data, fmt)
