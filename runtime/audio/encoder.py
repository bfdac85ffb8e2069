"""Encoding clips with the audio tower: a batch of clips (their log-mel features, from the frontend's
feature extractor) in one forward pass, and an in-process encoder with its own LRU cache (tests, and
anything that runs the model without an audio server)."""
from __future__ import annotations

import numpy as np
import torch

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.audio_qwen2 import Qwen2AudioTower
from llaunch.runtime.visual.embed_cache import EmbedCache


@torch.inference_mode()
def encode_clips(tower: Qwen2AudioTower, clips: list[ImageRef]) -> list[torch.Tensor]:
    """Each clip's embeddings [tokens, hidden], from one forward pass over all of them."""
    mel = tower.arch.num_mel_bins
    features = [torch.from_numpy(np.frombuffer(c.pixels, dtype=np.float32).reshape(mel, -1).copy()) for c in clips]
    return tower(features, [c.grid[0] for c in clips])


class InProcessAudioEmbeds:
    """`embeddings(clips)` encoded here, misses of one call in one batch, hits from an LRU cache."""

    def __init__(self, tower: Qwen2AudioTower, cache_bytes: int):
        self.tower = tower
        self.cache = EmbedCache(cache_bytes)
        self.encoded_clips = 0

    def embeddings(self, clips: list[ImageRef]) -> list[torch.Tensor]:
        found = {c.hash: self.cache.get(c.hash) for c in clips}
        missing = list({c.hash: c for c in clips if found[c.hash] is None}.values())
        if missing:
            for c, emb in zip(missing, encode_clips(self.tower, missing)):
                found[c.hash] = emb
                self.cache.put(c.hash, emb)
            self.encoded_clips += len(missing)
        return [found[c.hash] for c in clips]
