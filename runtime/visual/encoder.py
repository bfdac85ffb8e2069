"""Encoding images with the vision tower: a batch of preprocessed images (their pixel values, from the
frontend's image processor) in one forward pass, and an in-process encoder with its own LRU cache
(tests, and anything that runs the model without a visual server)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.vision_qwen2 import Qwen2VisionTower
from llaunch.runtime.cache.embed_cache import EmbedCache


def batch_pixels(tower: Qwen2VisionTower, images: list[ImageRef]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The tower's input for these images: their patches back to back [patches, C·T·P·P] and grids."""
    a = tower.arch
    width = a.in_channels * a.temporal_patch_size * a.patch_size ** 2
    pixels = torch.cat([torch.from_numpy(np.frombuffer(im.pixels, dtype=np.float32).reshape(-1, width).copy())
                        for im in images])
    return pixels, [tuple(im.grid) for im in images]


@torch.inference_mode()
def encode(tower: Qwen2VisionTower, images: list[ImageRef], before_forward=None) -> list[torch.Tensor]:
    """Each image's embeddings [tokens, out_hidden], from one forward pass over all of them;
    `before_forward(pixels, grids)`: visual.tp's leader hands the batch to its followers there."""
    pixels, grids = batch_pixels(tower, images)
    if before_forward is not None:
        pixels = before_forward(pixels, grids)
    out = tower(pixels, grids)
    sizes = [t * h * w // tower.arch.spatial_merge_size ** 2 for t, h, w in grids]
    return list(out.split(sizes))


class CachedEncoder:
    """`embeddings(items)` (images or clips): the misses of one call encoded together by `encode`, the
    hits from an LRU cache keyed by content hash (tests, and anything that runs a model without a
    visual server)."""

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
