"""visual.tp: the vision tower of a tiny Qwen2-VL checkpoint split over two gloo processes (a leader
handing its batches to a follower, runtime/encoder/tower_tp.py) gives the embeddings of the whole tower
(float32, CPU), for a batch of two images of different sizes and then a batch of one; a batch that
fails on one rank (or both) mid-forward, on the leader before the hand-over, or on the follower as it
allocates the batch's pixels, fails on the leader and the batch after it still gives the whole tower's
embeddings."""
from __future__ import annotations

import socket
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.loader import build_vision_tower
from llaunch.runtime.encoder import tower_tp
from llaunch.runtime.encoder.images import encode
from tests.fixtures.tiny_models import model_config_from_folder
from tests.fixtures.tiny_vl import write_tiny_qwen2_vl

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not

TP = 2
# (t, h, w) in patches; 16 patches fail on the follower, 8 on the leader, inside block 1 (FAIL_AT);
# "short": pixels one value short (the leader fails before the hand-over); "mismatch": 8 patches of
# pixels for a 16-patch grid (both ranks fail inside block 0); 20 patches: the follower cannot allocate
# the batch's pixel buffer (NO_ROOM)
GRIDS = [[(1, 4, 6), (1, 8, 4)], [(1, 4, 4)], [(1, 6, 6)], [(1, 2, 4)], [(1, 6, 2)], ["short", (1, 2, 2)],
         [(1, 2, 6)], ["mismatch", (1, 4, 4)], [(1, 6, 4)], [(1, 2, 10)], [(1, 2, 2)]]
FAIL_AT = {1: 16, 0: 8}  # rank → the patches of the batch whose block 1 raises there
NO_ROOM = 20  # patches of the batch whose pixel buffer the follower fails to allocate
FAILED = [1, 3, 5, 7, 9]


def batches(cfg) -> list[list[ImageRef]]:
    v = cfg.vision
    width = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
    gen = torch.Generator().manual_seed(1)
    out = []
    for b, grids in enumerate(GRIDS):
        kind, g = grids if isinstance(grids[0], str) else ("", None)
        pixels = [torch.randn(t * h * w, width, generator=gen).numpy().tobytes() for t, h, w in ([g] if g else grids)]
        if kind == "short":
            pixels = [pixels[0][:-4]]
        elif kind == "mismatch":
            pixels = [pixels[0][:len(pixels[0]) // 2]]
        out.append([ImageRef(hash=f"{b}.{i}", offset=0, grid=list(grid), pixels=px)
                    for i, (grid, px) in enumerate(zip([g] if g else grids, pixels))])
    return out


def fail_in_block_1(tower, patches: int) -> None:
    block = tower.blocks[1]
    forward = block.forward

    def failing(x, *args):
        if x.shape[0] == patches:
            raise RuntimeError("injected failure")
        return forward(x, *args)
    block.forward = failing


def no_room_for(patches: int) -> None:
    allocate = tower_tp.pixel_buffer

    def failing(n, *args):
        if n == patches:
            raise torch.OutOfMemoryError("injected: no room for the pixels")
        return allocate(n, *args)
    tower_tp.pixel_buffer = failing


def rank_main(rank: int, cfg, address: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    group, headers = tower_tp.join(TP, rank, address, torch.device("cpu"))
    try:
        tower = build_vision_tower(cfg, torch.device("cpu"), torch.float32, group)
        fail_in_block_1(tower, FAIL_AT[rank])
        if rank > 0:
            no_room_for(NO_ROOM)
            tower_tp.follow(tower, headers)  # returns at the leader's stop
            return
        leader = tower_tp.TowerLeader(headers, torch.device("cpu"))
        outs = []
        for images in batches(cfg):
            try:
                outs.append(leader.encode(tower, images))
            except Exception as e:
                outs.append(f"{type(e).__name__}: {e}")
        leader.stop()
        torch.save(outs, Path(out_dir) / "tp2.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("visual-tp")
    path = write_tiny_qwen2_vl(root / "tiny-qwen2-vl")
    cfg = replace(model_config_from_folder(path), vision=read_checkpoint(str(path)).arch["vision"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = mp.spawn(rank_main, args=(cfg, f"tcp://127.0.0.1:{port}", str(root)), nprocs=TP, join=False)
    deadline = time.monotonic() + 60
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:  # ranks out of step block in a collective: fail, not hang
            for p in ranks.processes:
                p.kill()
            pytest.fail("the visual tp ranks hung")
    whole = build_vision_tower(cfg, torch.device("cpu"), torch.float32)
    return [None if b in FAILED else encode(whole, images) for b, images in enumerate(batches(cfg))], \
        torch.load(root / "tp2.pt")


@pytest.mark.timeout(300)
def test_tp2_tower_embeddings_equal_the_whole_tower(runs):
    whole, split = runs
    assert [b for b, out in enumerate(split) if isinstance(out, str)] == FAILED
    assert "injected failure" not in split[1]  # the follower failed: rank 0 says another rank did
    assert "another visual.tp rank" in split[1]
    assert "injected failure" in split[3] and "reshape" in split[5] and "another" not in split[3] + split[5]
    assert "could not take the batch's pixels" in split[9]  # the follower lived on: batch 10 is whole
    for batch_whole, batch_split in zip(whole, split):
        if batch_whole is None:
            continue
        assert [e.shape for e in batch_split] == [e.shape for e in batch_whole]
        for a, b in zip(batch_whole, batch_split):
            assert a.abs().max() > 0.1  # embeddings that carry the image, not zeros
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-4)
