"""visual.tp > 1: one visual replica is visual.tp processes sharing one vision tower, split over them
(runtime/models/vision_qwen2.py). Rank 0 (visual.{v}) serves the routers and writes the embed cache;
before each forward pass it hands the batch (grids, then pixels) to the other ranks (visual.{v}.{r}),
which only follow: the same forward pass, their all-reduces meeting rank 0's. The batch's header
travels on a gloo group with no practical timeout, so an idle follower waits as long as it takes.
A batch that fails on any rank (an out-of-memory one, say) fails only its requests: the rank that
failed still issues the rest of the forward pass's all-reduces, then every rank agrees on the outcome
(`_settle`), so the next batch's collectives pair up as before. A follower that cannot allocate the
batch's pixels says so with the grids' exchange (an all-reduce that carries rank 0's grids and the
count of such ranks): then no rank broadcasts the pixels or runs the batch, and rank 0 fails it."""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.layers import RowParallelLinear, TpGroup
from llaunch.runtime.models.vision_qwen2 import Qwen2VisionTower
from llaunch.runtime.encoder.images import encode

log = logging.getLogger(__name__)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # followers wait for the next batch between requests
BATCH, STOP = 1, 0  # header kinds


@dataclass(frozen=True)
class CountingTpGroup(TpGroup):
    """A TpGroup that counts the all-reduces this rank issued since `issued[0]` was last reset."""

    issued: list = field(default_factory=lambda: [0], compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        super().all_reduce(x)
        self.issued[0] += 1
        return x


def _attempt(tower: Qwen2VisionTower, forward: Callable):
    """(forward(), None), or (None, the exception) when it raised part-way."""
    tower.tp.issued[0] = 0
    try:
        return forward(), None
    except Exception as e:
        return None, e.with_traceback(None)  # its frames hold the batch's activations: free them for the drain


def _attempt_alloc(patches: int, width: int, device: torch.device):
    """(the pixel buffer, None), or (None, the exception) when it could not be allocated."""
    try:
        return pixel_buffer(patches, width, device), None
    except Exception as e:
        return None, e.with_traceback(None)


def _settle(tower: Qwen2VisionTower, headers, patches: int, failed: bool) -> bool:
    """After this rank's forward pass over a batch of `patches`: whether every rank ran it whole.
    A rank that failed first issues the all-reduces it still owed (each RowParallelLinear issues one
    [patches, out] per pass), zeros, which its peers' pending ones pair with."""
    if failed:
        rows = [m for m in tower.modules() if isinstance(m, RowParallelLinear)]
        for m in rows[tower.tp.issued[0]:]:
            tower.tp.all_reduce(torch.zeros(patches, m.full_shape[0], dtype=m.weight.dtype, device=m.weight.device))
    ok = torch.tensor([0 if failed else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=headers)
    return bool(ok.item())


def _grids_and_refusals(grids: torch.Tensor, refused: bool, headers) -> int:
    """Rank 0's flat grids (others pass zeros) into `grids`, in place; returns how many ranks refused
    the batch (one all-reduce: the refusal rides along with the grids, costing no extra round)."""
    rows = torch.cat([grids, torch.tensor([int(refused)])])
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=headers)
    grids.copy_(rows[:-1])
    return int(rows[-1])


def pixel_buffer(patches: int, width: int, device: torch.device) -> torch.Tensor:
    """A follower's buffer for the batch's pixels (the allocation that may fail on a loaded device)."""
    return torch.empty(patches, width, dtype=torch.float32, device=device)


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
    return CountingTpGroup(rank=rank, size=tp), headers


class TowerLeader:
    """Rank 0's side: `encode(tower, images)` runs a batch with the followers; `stop()` at exit."""

    def __init__(self, headers, device: torch.device):
        self.headers, self.device = headers, device
        self.patches: Optional[int] = None  # the batch's patches once the followers have it

    def hand_over(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        # all that can fail comes before the first broadcast: a batch failing here never reaches the followers
        pixels = pixels.to(self.device).contiguous()
        header = torch.tensor([BATCH, pixels.shape[0], len(grids)])
        grid_rows = torch.tensor(grids, dtype=torch.int64).view(-1)
        dist.broadcast(header, 0, group=self.headers)
        if _grids_and_refusals(grid_rows, refused=False, headers=self.headers):
            raise RuntimeError("another visual.tp rank of this server could not take the batch's pixels "
                               "(its log says why)")
        dist.broadcast(pixels, 0)
        self.patches = pixels.shape[0]
        return pixels

    def encode(self, tower: Qwen2VisionTower, images: list[ImageRef]) -> list[torch.Tensor]:
        """Each image's embeddings, the followers running the same pass; raises when any rank failed
        the batch, leaving every rank ready for the next."""
        self.patches = None
        out, error = _attempt(tower, lambda: encode(tower, images, self.hand_over))
        if self.patches is None:  # failed before the hand-over: the followers never saw this batch
            raise error
        ok = _settle(tower, self.headers, self.patches, error is not None)
        if error is not None:
            raise error
        if not ok:
            raise RuntimeError("another visual.tp rank of this server failed the batch (its log says why)")
        return out

    def stop(self) -> None:
        try:
            dist.broadcast(torch.tensor([STOP, 0, 0]), 0, group=self.headers)
        except Exception as e:  # a follower already gone (the launcher stops them too)
            log.info("visual tp: followers not told to stop (%s)", e)


@torch.inference_mode()
def follow(tower: Qwen2VisionTower, headers) -> None:
    """A follower rank's loop: run each batch rank 0 hands over, until it says stop. A batch that
    fails here is logged and reported to rank 0, which fails its requests."""
    a = tower.arch
    width = a.in_channels * a.temporal_patch_size * a.patch_size ** 2
    while True:
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, 0, group=headers)
        kind, patches, images = header.tolist()
        if kind == STOP:
            return
        pixels, error = _attempt_alloc(patches, width, tower.device)
        if error is not None:
            log.warning("visual tp rank %d: no room for a batch of %d images (%d patches): %s: %s", tower.tp.rank,
                        images, patches, type(error).__name__, error)
        grids = torch.zeros(images * 3, dtype=torch.int64)
        if _grids_and_refusals(grids, refused=error is not None, headers=headers):
            del pixels
            continue  # some rank refused it: no rank runs it, rank 0 fails its requests
        dist.broadcast(pixels, 0)
        grid_list = [tuple(g) for g in grids.view(images, 3).tolist()]
        error = _attempt(tower, lambda: tower(pixels, grid_list))[1]
        if error is not None:
            log.warning("visual tp rank %d: a batch of %d images failed: %s: %s", tower.tp.rank, images,
                        type(error).__name__, error)
        _settle(tower, headers, patches, error is not None)
