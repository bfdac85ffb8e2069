"""The embed cache's shared memory: one file per visual server, cut into fixed blocks. The visual
server writes an image's embeddings into free blocks (runtime/cache/embed_store.py) and tells the
router which; workers map the file read-only and gather those blocks (runtime/cache/embed_reader.py).
No torch: the launcher plans the paths and removes leftovers with these functions."""
from __future__ import annotations

import os
import re

from llaunch.runtime.cache.host_pool import SHM_DIR

BLOCK_BYTES = 256 * 2**10  # an image of Qwen2-VL-7B at 1024x1024 (1,369 tokens x 3,584 bf16) takes 38


def embeds_path(instance: str, replica: int, shm_dir: str = SHM_DIR) -> str:
    """Visual server `replica`'s file; `instance` (the launcher's control endpoint) keeps instances apart."""
    tag = re.sub(r"[^A-Za-z0-9]+", "_", instance).strip("_")[-48:]
    return os.path.join(shm_dir if os.path.isdir(shm_dir) else "/tmp", f"llaunch-embeds-{tag}-{replica}")


def num_blocks(cache_mib: int) -> int:
    return max(cache_mib * 2**20 // BLOCK_BYTES, 1)
