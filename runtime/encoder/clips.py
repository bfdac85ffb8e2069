"""Encoding clips with the audio tower: a batch of clips (their log-mel features, from the frontend's
feature extractor) in one forward pass."""
from __future__ import annotations

import numpy as np
import torch

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.audio_qwen2 import Qwen2AudioTower


@torch.inference_mode()
def encode_clips(tower: Qwen2AudioTower, clips: list[ImageRef]) -> list[torch.Tensor]:
    """Each clip's embeddings [tokens, hidden], from one forward pass over all of them."""
    mel = tower.arch.num_mel_bins
    features = [torch.from_numpy(np.frombuffer(c.pixels, dtype=np.float32).reshape(mel, -1).copy()) for c in clips]
    return tower(features, [c.grid[0] for c in clips])
