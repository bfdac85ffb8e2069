"""Where the host KV tier's memory lives (cache.cpu_tokens > 0): one shared-memory file per worker
(dp replica × tp rank), created by the kv_host process (runtime/kv_host/process.py) before the
workers map it, so the pool outlives a worker and every rank of a node maps its share from one owner.
A rank's file holds K and V of `cpu_tokens` slots over all layers: [2, layers, slots, kv_heads, head_dim].
No torch: the launcher plans the paths and removes leftovers with these functions."""
from __future__ import annotations

import os
import re

SHM_DIR = "/dev/shm"


def pool_path(instance: str, dp_rank: int, tp_rank: int, shm_dir: str = SHM_DIR) -> str:
    """A worker's pool file; `instance` (the launcher's control endpoint) keeps instances apart."""
    tag = re.sub(r"[^A-Za-z0-9]+", "_", instance).strip("_")[-48:]
    return os.path.join(shm_dir if os.path.isdir(shm_dir) else "/tmp", f"llaunch-kv-{tag}-{dp_rank}.{tp_rank}")


def index_path(instance: str, dp_rank: int, shm_dir: str = SHM_DIR) -> str:
    """A replica's host-tier index (cache.dp_fetch: runtime/cache/host_index.py)."""
    return pool_path(instance, dp_rank, 0, shm_dir).rsplit(".", 1)[0] + ".index"


def pool_bytes(cfg) -> int:
    """One rank's file: cpu_tokens slots of its K/V bytes per token (runtime/models/memory.py)."""
    from llaunch.runtime.models.memory import rank_memory

    return cfg.cache.cpu_tokens * rank_memory(cfg).kv_per_token


def create_pool(path: str, size: int, others: int = 0) -> None:
    """Sized, then renamed into place: a worker that sees the name sees the whole file. `others`: bytes
    of this node's pools made before it. A tmpfs too small for every pool would crash a worker on its
    first write past the limit (SIGBUS), so that is refused here, naming the numbers."""
    st = os.statvfs(os.path.dirname(path))
    free = st.f_bavail * st.f_frsize
    if size + others > free:
        raise RuntimeError(f"{os.path.dirname(path)} has {free / 2**30:.2f} GiB free; the host KV tier needs "
                           f"{(size + others) / 2**30:.2f} GiB on this node: lower cache.cpu_tokens (or enlarge "
                           f"the tmpfs, e.g. docker --shm-size)")
    tmp = f"{path}.creating"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)  # tmpfs pages are taken as they are first written
    finally:
        os.close(fd)
    os.replace(tmp, path)


def remove_pool(path: str) -> None:
    for p in (path, f"{path}.creating"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
