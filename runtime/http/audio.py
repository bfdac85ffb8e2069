"""The frontend's side of audio (Qwen2-Audio): a chat message's `input_audio` parts (OpenAI's shape:
base64 `data` + `format`) and `audio_url` parts (`data:` URLs only; http(s) is never fetched) are
audio parts for the chat template, which writes each clip's text; each clip is decoded
(runtime/http/audio_decode.py), checked against the audio.* limits, turned into log-mel features and
spliced into the prompt as its tokens (runtime/http/audio_features.py). Every failure is a 400 naming the part.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Optional

from llaunch.runtime.config import AudioConfig, ModelConfig
from llaunch.runtime.web.errors import bad_request
from llaunch.runtime.ipc.messages import ImageRef

AUDIO_PARTS = ("input_audio", "audio_url")
MIME_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav",
                "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac",
                "audio/ogg": "ogg"}


@dataclass(frozen=True)
class AudioSource:
    data: str  # base64
    format: str  # wav | mp3 | flac | ... (decode() says which it reads)


class MediaParts(list):
    """A chat request's media parts in order, as (source, param); `audio`: the model takes audio parts
    (Qwen2-Audio), else image_url parts (Qwen2-VL)."""

    def __init__(self, inputs):
        super().__init__()
        self.audio = isinstance(inputs, AudioInputs)


def audio_source(part, param: str) -> AudioSource:
    """An input_audio or audio_url part's base64 bytes and format."""
    if part.type == "input_audio":
        a = part.input_audio
        if a is None or not a.data or not a.format:
            raise bad_request("An input_audio part needs input_audio.data (base64) and input_audio.format.", param=param)
        return AudioSource(a.data, a.format.lower())
    url = part.audio_url.url if part.audio_url is not None else None
    if not url:
        raise bad_request("An audio_url part needs audio_url.url.", param=param)
    if url.startswith(("http://", "https://")):
        raise bad_request("Audio URLs are not fetched: send the clip as a data: URL or an input_audio part.",
                          param=param)
    header, _, payload = url.partition(",")
    if not header.startswith("data:") or ";base64" not in header:
        raise bad_request("An audio_url must be a base64 data: URL (data:audio/wav;base64,...).", param=param)
    mime = header.removeprefix("data:").split(";")[0].lower()
    return AudioSource(payload, MIME_FORMATS.get(mime, mime.removeprefix("audio/")))


class AudioInputs:
    """Reads, checks and featurizes a request's clips (one per frontend process)."""

    def __init__(self, model: ModelConfig, audio: AudioConfig):
        from llaunch.runtime.http.audio_features import AudioFeatures

        self.audio = audio
        self.features = AudioFeatures(model.audio, model.vocab_size, model.path)
        self.image_token_id = self.features.audio_token_id  # what a clip's tokens are checked as

    def clip(self, source: AudioSource, param: str):
        from llaunch.runtime.http.audio_decode import AudioDecodeError, ClipTooLong, decode
        from llaunch.runtime.http.audio_features import SAMPLING_RATE
        from llaunch.runtime.models.audio_qwen2 import audio_tokens

        limit = self.audio.max_clip_bytes
        if len(source.data) * 3 // 4 > limit:
            raise bad_request(f"The audio clip is larger than audio.max_clip_bytes={limit}.", param=param)
        try:
            data = base64.b64decode(source.data, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("The audio data is not valid base64.", param=param) from None
        try:
            waveform = decode(data, source.format, SAMPLING_RATE, self.audio.max_clip_seconds)
            seconds = waveform.size / SAMPLING_RATE
        except ClipTooLong as e:  # its header says so: not decoded at all
            seconds = e.seconds
        except AudioDecodeError as e:
            raise bad_request(f"The audio cannot be read: {e}.", param=param) from None
        if seconds > self.audio.max_clip_seconds:
            raise bad_request(f"The audio clip lasts {seconds:.1f} s, longer than audio.max_clip_seconds="
                              f"{self.audio.max_clip_seconds}.", param=param)
        clip = self.features.process(waveform)
        if audio_tokens(clip.frames) < 1:  # the encoder has no output for it (and failed its whole batch)
            raise bad_request(f"The audio clip is too short: {seconds * 1000:.0f} ms gives the audio encoder no "
                              "output (it needs 3 mel frames, about 25 ms at 16 kHz).", param=param)
        return clip

    def chat(self, req, prompt_ids: list[int], parts: Optional[list]) -> tuple[list[int], list[ImageRef]]:
        """A chat request's prompt with its clips spliced in (unchanged without clips)."""
        if not parts:
            return prompt_ids, []
        if len(parts) > self.audio.max_clips_per_request:
            raise bad_request(f"{len(parts)} audio clips: more than audio.max_clips_per_request="
                              f"{self.audio.max_clips_per_request}.", param="messages")
        if req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not supported with audio.", param="prompt_logprobs")
        clips = [self.clip(source, param) for source, param in parts]
        try:
            return self.features.splice(prompt_ids, clips)
        except ValueError as e:
            raise bad_request(f"{e} (is <|AUDIO|> in the text?).", param="messages") from None
