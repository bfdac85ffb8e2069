"""A visual server process (visual.{v}, visual.dp of them): loads the model's vision tower (Qwen2-Audio:
audio.{a}, audio.dp of them, its audio tower encoding clips the same way: a clip travels as an ImageRef), owns one
shared-memory embed cache (runtime/cache/embed_store.py), and answers the routers' EncodeImages,
encoding images in batches of up to visual.batch_size / audio.batch_size (runtime/encoder/batcher.py). Workers read the
embeddings from the cache; the routers hold a request until its images are there
(runtime/router/image_gate.py). Its death takes the graph down (the launcher supervises it).
visual.tp > 1: visual.{v} leads visual.{v}.1.. (its tower split over them, runtime/encoder/tower_tp.py)."""
from __future__ import annotations

import logging
from typing import Optional

import torch
import zmq

from llaunch.runtime import bootstrap
from llaunch.runtime.ipc.sockets import Receiver, Sender
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.models.loader import build_audio_tower, build_vision_tower
from llaunch.runtime.encoder_servers import encoder_servers
from llaunch.runtime.encoder import tower_tp
from llaunch.runtime.encoder.batcher import VisualBatcher
from llaunch.runtime.encoder.tower_tp import TowerLeader
from llaunch.runtime.cache.embed_shm import num_blocks
from llaunch.runtime.cache.embed_store import EmbedStore
from llaunch.runtime.encoder.clips import encode_clips
from llaunch.runtime.encoder.images import encode as encode_images
from llaunch.runtime.ipc.encoder import EncodeImages, ReleaseImages, VisualInbound

log = logging.getLogger(__name__)
IDLE_WAIT_MS = 200
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def tower_encoder(model, device: torch.device, dtype: torch.dtype, tp: TpGroup = TpGroup(),
                  leader: Optional[TowerLeader] = None):
    """refs → their embeddings, by the model's vision tower or (Qwen2-Audio) its audio tower;
    visual.tp > 1: this rank's part of the vision tower, `leader` handing each batch to the others."""
    if model.audio:
        audio_tower = build_audio_tower(model, device, dtype)
        return lambda clips: encode_clips(audio_tower, clips)
    tower = build_vision_tower(model, device, dtype, tp)
    return (lambda images: leader.encode(tower, images)) if leader else (lambda images: encode_images(tower, images))


def serve(batcher: VisualBatcher, inbox: Receiver, routers: dict[int, Sender], stop: bootstrap.StopFlag) -> None:
    while not stop.requested:
        msg = inbox.recv(timeout_ms=0 if batcher.busy else IDLE_WAIT_MS)
        while msg is not None:
            if isinstance(msg, EncodeImages):
                batcher.add(msg)
            elif isinstance(msg, ReleaseImages):
                batcher.release(msg.router, msg.request_ids)
            msg = inbox.recv_nowait()
        for router, ready in batcher.step():
            if ready.error:
                log.warning("request %s: %s", ready.request_id, ready.error)
            routers[router].send(ready)


def main() -> None:
    cfg, spec = bootstrap.start()
    ctx = zmq.Context()
    stage = bootstrap.StageReporter(ctx, cfg, spec)
    if spec.gpus:
        device = torch.device("cuda", 0)  # the launcher sets CUDA_VISIBLE_DEVICES to its GPU
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # the workers have the cores
    servers = encoder_servers(cfg)  # visual.* or audio.*, by the model's kind
    tp, headers = tower_tp.join(servers.tp, spec.tp_rank, spec.connects.get("dist"), device)
    stage("loading the audio tower" if cfg.model.audio else "loading the vision tower")
    if spec.tp_rank > 0:  # a follower of visual.{index}: no sockets, no cache
        tower = build_vision_tower(cfg.model, device, DTYPES[cfg.model.dtype.value], tp)
        bootstrap.report_ready(ctx, cfg, spec, device=str(device), tp_rank=spec.tp_rank)
        try:
            tower_tp.follow(tower, headers)
        except KeyboardInterrupt:
            pass
        return
    leader = tower_tp.TowerLeader(headers, device) if tp.size > 1 else None
    encode = tower_encoder(cfg.model, device, DTYPES[cfg.model.dtype.value], tp, leader)
    store = EmbedStore(spec.binds["embeds"], num_blocks(servers.embed_cache_mib))
    stop = bootstrap.StopFlag().install()
    try:
        def encode_bytes(images):
            return [e.contiguous().view(torch.uint8).flatten().cpu().numpy() for e in encode(images)]

        batcher = VisualBatcher(store, encode_bytes, servers.batch_size, replica=spec.index)
        inbox = Receiver(ctx, spec.binds["encode"], VisualInbound)
        routers = {int(k.split(".")[1]): Sender(ctx, addr) for k, addr in spec.connects.items() if k.startswith("ready.")}
        bootstrap.report_ready(ctx, cfg, spec, device=str(device), cache_mib=servers.embed_cache_mib,
                               batch=servers.batch_size)
        serve(batcher, inbox, routers, stop)
    except KeyboardInterrupt:
        pass
    finally:
        if leader is not None:
            leader.stop()
        store.close()


if __name__ == "__main__":
    main()
