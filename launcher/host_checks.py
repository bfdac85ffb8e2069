"""Checks of this host at start that warn rather than refuse (the seed's shared-memory check)."""
from __future__ import annotations

import os
from typing import Callable, Optional

from llaunch.runtime.config import LlaunchConfig

# NCCL's intra-node transport and gloo's buffers live in /dev/shm; Docker's default of 64 MiB makes
# NCCL fail or hang at start. NCCL's own advice is a container with --shm-size=1g or --ipc=host.
SHM_MIN_BYTES = 1 << 30


def shm_warning(cfg: LlaunchConfig, path: str = "/dev/shm",
                statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> Optional[str]:
    """A warning when several worker ranks share this node and `path` is smaller than SHM_MIN_BYTES."""
    p = cfg.parallel
    ranks = p.tp * p.dp // max(p.nnodes, 1)
    if not p.shm_warning or ranks < 2:
        return None
    try:
        st = statvfs(path)
    except OSError:
        return f"{path} is missing: {ranks} worker ranks on this node exchange data through it (NCCL, gloo)"
    size = st.f_blocks * st.f_frsize
    if size >= SHM_MIN_BYTES:
        return None
    return (f"{path} holds {size >> 20} MiB: the {ranks} worker ranks on this node exchange data through it "
            f"(NCCL, gloo), which needs at least {SHM_MIN_BYTES >> 20} MiB; in a container pass --shm-size=1g "
            "or --ipc=host. parallel.shm_warning=false silences this")
