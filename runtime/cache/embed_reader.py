"""The workers' side of the embed cache: map each visual server's file read-only and gather an image's
(or an audio clip's) embeddings from the blocks its ImageRef names (pinned there until the request ends)."""
from __future__ import annotations

import mmap
import os
import time
from typing import Callable

import numpy as np
import torch

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.cache.embed_shm import BLOCK_BYTES


def map_file(path: str, timeout_s: float) -> mmap.mmap:
    """The visual server creates the file as it starts, maybe after this worker: wait for it."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the embed cache {path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.1)
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def image_tokens(merge: int) -> Callable[[ImageRef], int]:
    """Qwen2-VL: an image's tokens from its patch grid (t·h·w / merge²)."""
    return lambda im: im.grid[0] * im.grid[1] * im.grid[2] // merge ** 2


class ShmEmbeds:
    """`embeddings(images)` for ImageRows / AudioRows (runtime/worker/), read from the visual servers;
    `tokens(ref)`: how many embeddings a ref has (image_tokens, or audio_tokens of a clip's frames)."""

    def __init__(self, paths: list[str], tokens: Callable[[ImageRef], int], hidden: int, dtype: torch.dtype,
                 device: torch.device, timeout_s: float):
        self.tokens, self.hidden, self.dtype, self.device = tokens, hidden, dtype, device
        self._maps = [np.frombuffer(map_file(p, timeout_s), dtype=np.uint8) for p in paths]

    def embeddings(self, images: list[ImageRef]) -> list[torch.Tensor]:
        out = []
        for im in images:
            tokens = self.tokens(im)
            nbytes = tokens * self.hidden * self.dtype.itemsize
            m = self._maps[im.replica]
            raw = np.concatenate([m[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES] for b in im.blocks])[:nbytes]
            if raw.size != nbytes:
                raise RuntimeError(f"image {im.hash[:12]}: {raw.size} bytes in its blocks, {nbytes} expected")
            t = torch.frombuffer(bytearray(raw.tobytes()), dtype=self.dtype).view(tokens, self.hidden)
            out.append(t.to(self.device))
        return out
