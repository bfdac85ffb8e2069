"""visual.tp=2 on two GPUs at Qwen2-VL-7B's and Qwen2.5-VL-7B's vision shapes (conf/model/qwen2-vl-7b.yaml,
qwen2.5-vl-7b.yaml: its window-attention tower; model.load_format=dummy weights, bfloat16): the tower split over two processes (NCCL all-reduces, the leader handing its batch of two
1,024x1,024 images to the follower, runtime/encoder/tower_tp.py) gives the whole tower's embeddings up to
bfloat16 rounding (the sums run in another order), after a batch the follower had no memory for failed on the
leader alone (NCCL kept in step: no rank broadcast its pixels)."""
from __future__ import annotations

import os
import socket
import tempfile

import numpy as np
import pytest
import torch

from gpu.conftest import REPO

GRID, IMAGES = [1, 74, 74], 2  # 1,024 px rounds to 1,036 = 74 patches of 14
NO_ROOM = [1, 4, 4]  # a one-image batch whose pixel buffer the follower fails to allocate (injected)


def _tower(tp, device, profile: str):
    import yaml

    from llaunch.runtime.models.vision_qwen2 import VisionArch
    from llaunch.runtime.models.vision_qwen2_5 import tower_class
    from llaunch.runtime.models.weights import DummySource, load_from

    arch = VisionArch.from_dict(yaml.safe_load((REPO / "conf" / "model" / f"{profile}.yaml").read_text())["vision"])
    tower = tower_class(arch)(arch, device, torch.bfloat16, tp)
    load_from(tower, DummySource(0, device, full_tensors=True))  # whole tensors drawn, then sliced: one model
    return tower.eval()


def _images(tower, grid=GRID, count=IMAGES):
    from llaunch.runtime.ipc.messages import ImageRef

    a = tower.arch
    width = a.in_channels * a.temporal_patch_size * a.patch_size ** 2
    rng = np.random.default_rng(0)
    return [ImageRef(hash=f"{i:064x}", offset=0, grid=grid, pixels=rng.standard_normal(
        (grid[0] * grid[1] * grid[2], width), dtype=np.float32).tobytes()) for i in range(count)]


def _rank_main(rank: int, port: int, out: str, profile: str) -> None:
    import torch.distributed as dist

    from llaunch.runtime.encoder import tower_tp

    device = torch.device("cuda", rank)
    group, headers = tower_tp.join(2, rank, f"tcp://127.0.0.1:{port}", device)
    try:
        tower = _tower(group, device, profile)
        if rank == 1:
            allocate = tower_tp.pixel_buffer
            no_room = NO_ROOM[0] * NO_ROOM[1] * NO_ROOM[2]
            tower_tp.pixel_buffer = lambda n, *a: (allocate(n, *a) if n != no_room
                                                   else torch.empty(1 << 40, device=device))  # 4 TiB: a real CUDA OOM
            tower_tp.follow(tower, headers)
            return
        leader = tower_tp.TowerLeader(headers, device)
        try:  # the follower cannot take this batch: it fails here, and both ranks go on in step
            leader.encode(tower, _images(tower, NO_ROOM, 1))
            raise AssertionError("the batch the follower refused did not fail")
        except RuntimeError as e:
            assert "could not take the batch's pixels" in str(e), e
        split = [e.float().cpu() for e in leader.encode(tower, _images(tower))]
        leader.stop()
        torch.save(split, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="visual.tp=2 needs two GPUs")
@pytest.mark.parametrize("profile", ["qwen2-vl-7b", "qwen2.5-vl-7b"])
def test_visual_tp2_embeddings_match_the_whole_tower(profile):
    import torch.multiprocessing as mp

    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.encoder.images import encode

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "tp2.pt")
        mp.spawn(_rank_main, args=(port, out, profile), nprocs=2)
        split = torch.load(out)
    tower = _tower(TpGroup(), torch.device("cuda", 0), profile)
    whole = [e.float().cpu() for e in encode(tower, _images(tower))]
    for a, b in zip(whole, split):
        assert a.shape == b.shape == (GRID[1] * GRID[2] // 4, tower.arch.hidden_size)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        rel = (a - b).norm() / a.norm()
        print(f"visual tp2 vs tp1: min cosine {cos.min().item():.5f}, relative error {rel.item():.4f}")
        assert cos.min() > 0.995 and rel < 0.05, (cos.min().item(), rel.item())
