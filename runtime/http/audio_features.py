"""Clips → what the audio tower reads (Qwen2-Audio): a 16 kHz mono waveform's log-mel features by
transformers' WhisperFeatureExtractor (the checkpoint's preprocessor_config.json, else Qwen2-Audio's
defaults), padded to 30 s as transformers does and then cut to the frames the encoder reads; then each
clip's one <|AUDIO|> token in the rendered prompt becomes its tokens.

A clip's tokens carry the id vocab_size + the low 31 bits of its features' hash, not <|AUDIO|>: the
prompt cache then shares the KV of a repeated clip and never of two different clips. A clip travels as
an ImageRef (the embed cache, the router's gate and the worker's reader key on its hash alike) with
grid = [valid mel frames] and pixels = float32 features [num_mel_bins, kept_frames(frames)].
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.audio_qwen2 import audio_tokens, kept_frames

SAMPLING_RATE = 16000


@dataclass(frozen=True)
class ProcessedClip:
    hash: str
    features: np.ndarray  # float32 [num_mel_bins, kept_frames(frames)]
    frames: int  # valid mel frames (10 ms each), at most 3,000 (30 s)


class AudioFeatures:
    def __init__(self, audio: dict, vocab_size: int, path: str | None = None):
        from transformers import WhisperFeatureExtractor

        self.vocab_size = vocab_size
        self.audio_token_id = int(audio["audio_token_id"])
        if path and os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            self.extractor = WhisperFeatureExtractor.from_pretrained(path)
        else:
            self.extractor = WhisperFeatureExtractor(feature_size=int(audio.get("num_mel_bins", 128)),
                                                     sampling_rate=SAMPLING_RATE, return_attention_mask=True)
        self.max_frames = 2 * int(audio.get("max_source_positions", 1500))

    def process(self, waveform: np.ndarray) -> ProcessedClip:
        """A mono float waveform at 16 kHz (longer than 30 s: cut to 30 s, as transformers does)."""
        out = self.extractor(np.asarray(waveform, dtype=np.float32), sampling_rate=SAMPLING_RATE,
                             return_attention_mask=True, padding="max_length", return_tensors="np")
        frames = int(out["attention_mask"][0].sum())
        features = np.ascontiguousarray(out["input_features"][0][:, :kept_frames(frames, self.max_frames)],
                                        dtype=np.float32)
        digest = hashlib.sha256(features.tobytes() + bytes(str(frames), "ascii")).hexdigest()
        return ProcessedClip(digest, features, frames)

    def token_id(self, clip: ProcessedClip) -> int:
        return self.vocab_size + int(clip.hash[:8], 16) % 2**31

    def splice(self, prompt_ids: list[int], clips: list[ProcessedClip]) -> tuple[list[int], list[ImageRef]]:
        """The prompt with each <|AUDIO|> grown into its clip's tokens, and the clips' refs."""
        places = [i for i, t in enumerate(prompt_ids) if t == self.audio_token_id]
        if len(places) != len(clips):
            raise ValueError(f"the prompt holds {len(places)} audio placeholders for {len(clips)} clips")
        out, refs, last = [], [], 0
        for place, clip in zip(places, clips):
            out.extend(prompt_ids[last:place])
            refs.append(ImageRef(hash=clip.hash, offset=len(out), grid=[clip.frames], pixels=clip.features.tobytes()))
            out.extend([self.token_id(clip)] * audio_tokens(clip.frames))
            last = place + 1
        out.extend(prompt_ids[last:])
        return out, refs
