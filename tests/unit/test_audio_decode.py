"""Decoding clips for Qwen2-Audio: PCM WAV at other rates and channel counts comes out as mono 16 kHz
(a resampled tone equals the tone sampled at 16 kHz); FLAC decodes to its exact samples, MP3 and OGG
Vorbis (lossy) to their source; what we cannot read, or bytes of another format than the one named, is
an AudioDecodeError; a stream whose header says it is too long is ClipTooLong before decoding."""
import io
import wave

import numpy as np
import pytest

from llaunch.runtime.http.audio_decode import AudioDecodeError, ClipTooLong, decode


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


def encoded(samples: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    """`samples` [frames, channels] written by libsndfile (soundfile) as `fmt`."""
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def test_flac_decodes_to_its_exact_samples():
    ints = (np.random.default_rng(0).standard_normal(8000) * 6000).clip(-32768, 32767).astype(np.int16)
    out = decode(encoded(ints[:, None], 16000, "FLAC", "PCM_16"), "flac")
    assert out.dtype == np.float32 and np.array_equal(out, ints.astype(np.float32) / 32768)


@pytest.mark.parametrize("fmt,subtype,name", [("FLAC", "PCM_24", "flac"), ("MP3", "MPEG_LAYER_III", "mp3"),
                                              ("OGG", "VORBIS", "ogg")])
def test_44k_stereo_becomes_the_16k_tone(fmt, subtype, name):
    samples = np.repeat(tone(44100, 1.0)[:, None], 2, axis=1)
    out = decode(encoded(samples, 44100, fmt, subtype), name)
    expected = tone(16000, 1.0)
    assert len(out) == len(expected)
    inner = slice(200, -200)  # the filter's edges see the silence outside the clip
    if name == "flac":  # lossless: as close as a WAV of the same bits
        assert np.abs(out[inner] - expected[inner]).max() < 2e-3
    else:  # lossy: the same waveform, not the same samples
        assert np.corrcoef(out[inner], expected[inner])[0, 1] > 0.99


@pytest.mark.parametrize("fmt,subtype,name", [("FLAC", "PCM_16", "flac"), ("MP3", "MPEG_LAYER_III", "mp3")])
def test_corrupt_or_mislabelled_clips_are_refused(fmt, subtype, name):
    good = encoded(tone(16000, 1.0)[:, None], 16000, fmt, subtype)
    corrupt = good[:64] if name == "mp3" else good[:len(good) // 2]  # a header alone / a stream cut short
    with pytest.raises(AudioDecodeError):
        decode(corrupt, name)
    with pytest.raises(AudioDecodeError, match="not wav"):
        decode(good, "wav")


def test_too_long_is_known_from_the_header():
    data = encoded(tone(16000, 3.0)[:, None], 16000, "FLAC", "PCM_16")
    with pytest.raises(ClipTooLong) as e:
        decode(data, "flac", max_seconds=2.0)
    assert e.value.seconds == pytest.approx(3.0)
    assert len(decode(data, "flac", max_seconds=3.0)) == 48000


@pytest.mark.parametrize("rate", [44101, 1000003])
def test_an_odd_sample_rate_is_refused_not_a_memory_bomb(rate):
    """44,101 Hz shares no factor with 16 kHz: its resampling filters would take 5.6 GB (1 MHz+3: 128 GB)."""
    with pytest.raises(AudioDecodeError, match=f"sample rate of {rate} Hz"):
        decode(wav_bytes(tone(rate, 0.01)[:, None], rate, 2), "wav")
