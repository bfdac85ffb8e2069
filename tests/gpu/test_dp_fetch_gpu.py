"""dp cache fetch's copy on a GPU (cache.dp_fetch, runtime/worker/host_kv.py): a replica's worker maps
another replica's pool file (registered with CUDA, like its own) and a KvMove with `replica` set copies
from it into its KV on the side stream that the compute stream waits for. Replica 0 demotes; replica 1
fetches those host slots into other GPU slots of its own cache and reads exactly replica 0's KV."""
from __future__ import annotations

import os
import uuid

import torch

from llaunch.runtime.cache.host_pool import SHM_DIR, create_pool, remove_pool
from llaunch.runtime.ipc.messages import KvMove
from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.worker.host_kv import HostKvPool

LAYERS, SLOTS, HOST_SLOTS, HEADS, DIM = 4, 4096, 2048, 4, 128


def kv_cache(dev, seed: int) -> KvCache:
    gen = torch.Generator(device=dev).manual_seed(seed)
    return KvCache(k=[torch.randn(SLOTS, HEADS, DIM, device=dev, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)],
                   v=[torch.randn(SLOTS, HEADS, DIM, device=dev, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)],
                   req_to_slots=torch.zeros((2, 16), dtype=torch.int32, device=dev))


def test_a_fetch_copies_another_replicas_host_slots_in_stream_order():
    dev = torch.device("cuda")
    shm = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    paths = [os.path.join(shm, f"llaunch-kv-test-{uuid.uuid4().hex}-{d}") for d in range(2)]
    for path in paths:
        create_pool(path, 2 * LAYERS * HOST_SLOTS * HEADS * DIM * 2)
    try:
        kv0, kv1 = kv_cache(dev, 0), kv_cache(dev, 1)
        zero = HostKvPool(kv0, paths[0], HOST_SLOTS, dev, timeout_s=5, peers={1: paths[1]})
        one = HostKvPool(kv1, paths[1], HOST_SLOTS, dev, timeout_s=5, peers={0: paths[0]})
        src = torch.randperm(SLOTS, device=dev)[:1500].tolist()
        host = torch.randperm(HOST_SLOTS)[:1500].tolist()
        want_k = [k[torch.tensor(src, device=dev)].clone() for k in kv0.k]
        want_v = [v[torch.tensor(src, device=dev)].clone() for v in kv0.v]
        zero.apply([KvMove(to_host=True, gpu_slots=src, host_slots=host)])
        torch.cuda.synchronize()  # the router publishes only after the demoting step returned
        dst = torch.randperm(SLOTS, device=dev)[:1500].tolist()
        one.apply([KvMove(to_host=False, gpu_slots=dst, host_slots=host, replica=0)])
        got_k = [k[torch.tensor(dst, device=dev)] for k in kv1.k]  # read on the compute stream
        got_v = [v[torch.tensor(dst, device=dev)] for v in kv1.v]
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            assert torch.equal(got_k[layer], want_k[layer]) and torch.equal(got_v[layer], want_v[layer])
        zero.close()
        one.close()
    finally:
        for path in paths:
            remove_pool(path)
