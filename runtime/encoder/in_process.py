"""In-process encoders with their own LRU cache: a model's images or clips encoded by its tower in the
calling process (tests, and anything that runs the model without an encoder server)."""
from __future__ import annotations

from typing import Callable

import torch

from llaunch.runtime.cache.embed_cache import EmbedCache
from llaunch.runtime.encoder.clips import encode_clips
from llaunch.runtime.encoder.images import encode
from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.audio_qwen2 import Qwen2AudioTower
from llaunch.runtime.models.vision_qwen2 import Qwen2VisionTower


class CachedEncoder:
    """`embeddings(items)` (images or clips): the misses of one call encoded together by `encode`, the
    hits from an LRU cache keyed by content hash."""

    def __init__(self, encode: Callable[[list[ImageRef]], list[torch.Tensor]], cache_bytes: int):
        self._encode = encode
        self.cache = EmbedCache(cache_bytes)
        self.encoded = 0  # items encoded (not served from the cache)

    def embeddings(self, items: list[ImageRef]) -> list[torch.Tensor]:
        found = {it.hash: self.cache.get(it.hash) for it in items}
        missing = list({it.hash: it for it in items if found[it.hash] is None}.values())
        if missing:
            for it, emb in zip(missing, self._encode(missing)):
                found[it.hash] = emb
                self.cache.put(it.hash, emb)
            self.encoded += len(missing)
        return [found[it.hash] for it in items]


class InProcessEmbeds(CachedEncoder):
    """Images encoded here by the vision tower."""

    def __init__(self, tower: Qwen2VisionTower, cache_bytes: int):
        super().__init__(lambda images: encode(tower, images), cache_bytes)
        self.tower = tower
        self.merge = tower.arch.spatial_merge_size


class InProcessAudioEmbeds(CachedEncoder):
    """Clips encoded here by the audio tower."""

    def __init__(self, tower: Qwen2AudioTower, cache_bytes: int):
        super().__init__(lambda clips: encode_clips(tower, clips), cache_bytes)
        self.tower = tower
