"""visual.tp: the vision tower of a tiny Qwen2-VL checkpoint split over two gloo processes (a leader
handing its batches to a follower, runtime/visual/tower_tp.py) gives the embeddings of the whole tower
(float32, CPU), for a batch of two images of different sizes and then a batch of one."""
from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llaunch.runtime.ipc.messages import ImageRef
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.visual import tower_tp
from llaunch.runtime.visual.encoder import encode
from llaunch.runtime.worker.image_rows import build_tower
from tests.fixtures.tiny_models import model_config_from_folder
from tests.fixtures.tiny_vl import write_tiny_qwen2_vl

TP = 2
GRIDS = [[(1, 4, 6), (1, 8, 4)], [(1, 6, 6)]]  # two batches, (t, h, w) in patches


def batches(cfg) -> list[list[ImageRef]]:
    v = cfg.vision
    width = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
    gen = torch.Generator().manual_seed(1)
    return [[ImageRef(hash=f"{b}.{i}", offset=0, grid=list(g),
                      pixels=torch.randn(g[0] * g[1] * g[2], width, generator=gen).numpy().tobytes())
             for i, g in enumerate(grids)] for b, grids in enumerate(GRIDS)]


def rank_main(rank: int, cfg, address: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    group, headers = tower_tp.join(TP, rank, address, torch.device("cpu"))
    try:
        tower = build_tower(cfg, torch.device("cpu"), torch.float32, group)
        if rank > 0:
            tower_tp.follow(tower, headers)  # returns at the leader's stop
            return
        leader = tower_tp.TowerLeader(headers, torch.device("cpu"))
        outs = [encode(tower, images, leader.hand_over) for images in batches(cfg)]
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
    mp.spawn(rank_main, args=(cfg, f"tcp://127.0.0.1:{port}", str(root)), nprocs=TP, join=True)
    whole = build_tower(cfg, torch.device("cpu"), torch.float32)
    return [encode(whole, images) for images in batches(cfg)], torch.load(root / "tp2.pt")


@pytest.mark.timeout(300)
def test_tp2_tower_embeddings_equal_the_whole_tower(runs):
    whole, split = runs
    assert [[e.shape for e in batch] for batch in split] == [[e.shape for e in batch] for batch in whole]
    for batch_whole, batch_split in zip(whole, split):
        for a, b in zip(batch_whole, batch_split):
            assert a.abs().max() > 0.1  # embeddings that carry the image, not zeros
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-4)
