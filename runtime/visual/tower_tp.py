"""visual.tp > 1: one visual replica is visual.tp processes sharing one vision tower, split over them
(runtime/models/vision_qwen2.py). Rank 0 (visual.{v}) serves the routers and writes the embed cache;
before each forward pass it hands the batch (grids, then pixels) to the other ranks (visual.{v}.{r}),
which only follow: the same forward pass, their all-reduces meeting rank 0's. The batch's header
travels on a gloo group with no practical timeout, so an idle follower waits as long as it takes."""
from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.vision_qwen2 import Qwen2VisionTower

log = logging.getLogger(__name__)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # followers wait for the next batch between requests
BATCH, STOP = 1, 0  # header kinds


def join(tp: int, rank: int, init_method: Optional[str], device: torch.device) -> tuple[TpGroup, object]:
    """This rank's TpGroup (NCCL on GPUs, gloo on CPU) and the gloo group that carries headers;
    (TpGroup(), None) at visual.tp=1."""
    if tp == 1:
        return TpGroup(), None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            world_size=tp, rank=rank)
    headers = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    log.info("visual tp rank %d/%d joined %s", rank, tp, init_method)
    return TpGroup(rank=rank, size=tp), headers


class TowerLeader:
    """Rank 0's side: `hand_over(pixels, grids)` before its own forward pass; `stop()` at exit."""

    def __init__(self, headers, device: torch.device):
        self.headers, self.device = headers, device

    def hand_over(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        dist.broadcast(torch.tensor([BATCH, pixels.shape[0], len(grids)]), 0, group=self.headers)
        dist.broadcast(torch.tensor(grids, dtype=torch.int64), 0, group=self.headers)
        pixels = pixels.to(self.device).contiguous()
        dist.broadcast(pixels, 0)
        return pixels

    def stop(self) -> None:
        try:
            dist.broadcast(torch.tensor([STOP, 0, 0]), 0, group=self.headers)
        except Exception as e:  # a follower already gone (the launcher stops them too)
            log.info("visual tp: followers not told to stop (%s)", e)


@torch.inference_mode()
def follow(tower: Qwen2VisionTower, headers) -> None:
    """A follower rank's loop: run each batch rank 0 hands over, until it says stop."""
    a = tower.arch
    width = a.in_channels * a.temporal_patch_size * a.patch_size ** 2
    while True:
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, 0, group=headers)
        kind, patches, images = header.tolist()
        if kind == STOP:
            return
        grids = torch.zeros(images, 3, dtype=torch.int64)
        dist.broadcast(grids, 0, group=headers)
        pixels = torch.empty(patches, width, dtype=torch.float32, device=tower.device)
        dist.broadcast(pixels, 0)
        tower(pixels, [tuple(g) for g in grids.tolist()])
