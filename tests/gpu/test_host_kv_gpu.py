"""The host KV tier's copies on a GPU (runtime/worker/host_kv.py): the pool file registered with CUDA,
copies on a side stream that the compute stream waits for. A demote then a write to the freed slots
on the compute stream (what the step's forward does) must leave the old KV in the pool; a promote
must bring it back exactly; another mapping of the file (another process's view) sees the data."""
from __future__ import annotations

import os
import uuid

import torch

from llaunch.runtime.cache.host_pool import SHM_DIR, create_pool, remove_pool
from llaunch.runtime.ipc.messages import KvMove
from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.worker.host_kv import HostKvPool

LAYERS, SLOTS, HOST_SLOTS, HEADS, DIM = 4, 4096, 2048, 4, 128


def test_demote_then_promote_round_trips_and_orders_with_the_compute_stream():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = KvCache(k=[torch.randn(SLOTS, HEADS, DIM, device=dev, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)],
                 v=[torch.randn(SLOTS, HEADS, DIM, device=dev, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)],
                 req_to_slots=torch.zeros((2, 16), dtype=torch.int32, device=dev))
    path = os.path.join(SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp", f"llaunch-kv-test-{uuid.uuid4().hex}")
    nbytes = 2 * LAYERS * HOST_SLOTS * HEADS * DIM * 2
    create_pool(path, nbytes)
    try:
        pool = HostKvPool(kv, path, HOST_SLOTS, dev, timeout_s=5)
        src = torch.randperm(SLOTS, device=dev)[:1500].tolist()
        host = torch.randperm(HOST_SLOTS)[:1500].tolist()
        before_k = [k[torch.tensor(src, device=dev)].clone() for k in kv.k]
        before_v = [v[torch.tensor(src, device=dev)].clone() for v in kv.v]
        pool.apply([KvMove(to_host=True, gpu_slots=src, host_slots=host)])
        for layer in range(LAYERS):  # the next step's forward reuses the freed slots at once
            kv.k[layer][torch.tensor(src, device=dev)] = 0
            kv.v[layer][torch.tensor(src, device=dev)] = 0
        dst = [(s + 7) % SLOTS for s in src]  # elsewhere: promoted into other slots
        pool.apply([KvMove(to_host=False, gpu_slots=dst, host_slots=host)])
        got_k = [k[torch.tensor(dst, device=dev)] for k in kv.k]  # read on the compute stream
        got_v = [v[torch.tensor(dst, device=dev)] for v in kv.v]
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            assert torch.equal(got_k[layer], before_k[layer]) and torch.equal(got_v[layer], before_v[layer])
        view = torch.from_file(path, shared=True, size=nbytes // 2, dtype=torch.bfloat16).view(
            2, LAYERS, HOST_SLOTS, HEADS, DIM)
        assert torch.equal(view[0, LAYERS - 1][torch.tensor(host)], before_k[LAYERS - 1].cpu())
        pool.close()
    finally:
        remove_pool(path)


def test_a_pool_mapped_again_registers_again():
    """A pool dropped without close() and one closed both give their registrations back: mapping the
    same file again (the same address, as a worker or a test process that builds a pool twice gets it)
    registers again instead of failing with cudaErrorHostMemoryAlreadyRegistered (712)."""
    import gc

    dev = torch.device("cuda")
    kv = KvCache(k=[torch.zeros(SLOTS, HEADS, DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)],
                 v=[torch.zeros(SLOTS, HEADS, DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)],
                 req_to_slots=torch.zeros((2, 16), dtype=torch.int32, device=dev))
    path = os.path.join(SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp", f"llaunch-kv-test-{uuid.uuid4().hex}")
    create_pool(path, 2 * LAYERS * HOST_SLOTS * HEADS * DIM * 2)
    try:
        for round_ in range(4):
            pool = HostKvPool(kv, path, HOST_SLOTS, dev, timeout_s=5)
            pool.apply([KvMove(to_host=True, gpu_slots=[round_], host_slots=[round_])])
            if round_ % 2:
                pool.close()
            del pool
            gc.collect()
        torch.cuda.synchronize()
    finally:
        remove_pool(path)
