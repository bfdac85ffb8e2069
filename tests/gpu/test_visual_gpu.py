"""The visual server's work on a GPU at Qwen2-VL-7B's vision shape (conf/model/qwen2-vl-7b.yaml, random
weights, bfloat16): a batch of visual.batch_size 1,024x1,024 images encoded in one pass, written to the
shared-memory embed cache and read back by a worker (runtime/cache/embed_reader.py) bit for bit, each
close to the tower's output for that image alone (the batch does not mix images), the batch within the
memory the workers leave free at cache.mem_fraction=0.9."""
from __future__ import annotations

import os
import uuid

import numpy as np
import torch

from llaunch.runtime.cache.host_pool import SHM_DIR
from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.vision_qwen2 import Qwen2VisionTower, VisionArch
from llaunch.runtime.encoder.batcher import VisualBatcher
from llaunch.runtime.cache.embed_reader import ShmEmbeds, image_tokens
from llaunch.runtime.cache.embed_shm import num_blocks
from llaunch.runtime.cache.embed_store import EmbedStore
from llaunch.runtime.encoder.images import encode
from llaunch.runtime.ipc.encoder import EncodeImages
from gpu.conftest import REPO

BATCH, GRID = 8, [1, 74, 74]  # 1,024 px rounds to 1,036 = 74 patches of 14


def test_a_batch_of_1024px_images_round_trips_through_the_embed_cache():
    import yaml

    vision = yaml.safe_load((REPO / "conf" / "model" / "qwen2-vl-7b.yaml").read_text())["vision"]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    tower = Qwen2VisionTower(VisionArch.from_dict(vision), dev, torch.bfloat16).eval()
    for p in tower.parameters():
        p.normal_(0, 0.02)
    a = tower.arch
    width = a.in_channels * a.temporal_patch_size * a.patch_size ** 2
    rng = np.random.default_rng(0)
    images = [ImageRef(hash=f"{i:064x}", offset=0, grid=GRID, pixels=rng.standard_normal(
        (GRID[0] * GRID[1] * GRID[2], width), dtype=np.float32).tobytes()) for i in range(BATCH)]
    path = os.path.join(SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp", f"llaunch-embeds-test-{uuid.uuid4().hex}")
    store = EmbedStore(path, num_blocks(512))
    try:
        batches, outs = [], []

        def encode_bytes(ims):
            batches.append(len(ims))
            outs.extend(encode(tower, ims))
            return [e.contiguous().view(torch.uint8).flatten().cpu().numpy() for e in outs[-len(ims):]]

        batcher = VisualBatcher(store, encode_bytes, batch_size=BATCH)
        batcher.add(EncodeImages(request_id="r", router=0, images=images))
        torch.cuda.reset_peak_memory_stats()
        [(_, ready)] = batcher.step()
        peak = torch.cuda.max_memory_allocated()
        assert ready.error is None and batches == [BATCH]
        reader = ShmEmbeds([path], image_tokens(a.spatial_merge_size), a.hidden_size, torch.bfloat16, dev, 5.0)
        got = reader.embeddings(ready.images)
        for i in (0, BATCH - 1):
            alone = encode(tower, [images[i]])[0]
            assert got[i].shape == (GRID[1] * GRID[2] // 4, a.hidden_size) and torch.equal(got[i], outs[i])
            torch.testing.assert_close(got[i], alone, atol=2e-2, rtol=2e-2)  # batched vs alone: kernel choice
        total = torch.cuda.get_device_properties(dev).total_memory
        assert peak < 0.1 * total, f"a batch of {BATCH} images peaks at {peak / 2**30:.1f} GiB"
    finally:
        store.close()
