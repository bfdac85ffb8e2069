"""Encoding images with the vision tower: a batch of preprocessed images (their pixel values, from the
frontend's image processor) in one forward pass."""
from __future__ import annotations

import numpy as np
import torch

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.vision_qwen2 import Qwen2VisionTower


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
