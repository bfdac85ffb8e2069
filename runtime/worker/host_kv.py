"""A worker's share of the host KV tier (cache.cpu_tokens): its pool file (made by the kv_host
process, runtime/cache/host_pool.py) mapped as [2, layers, slots, kv_heads, head_dim], and the copies
each plan asks for (StepPlan.kv_moves), applied in order before the step's forward.

On a GPU the mapping is page-locked and registered with CUDA, so the copy kernels read and write it
directly (zero-copy over the bus); they run on a side stream that the forward's stream waits for:
the host never blocks on a copy, and the copies overlap the step still running (the slots they touch
are not used by any step in flight: the router moves only unreferenced cached KV and free slots)."""
from __future__ import annotations

import os
import time
import weakref
from typing import Optional

import torch

from llaunch.runtime.ipc.messages import KvMove
from llaunch.runtime.models.batch import KvCache

CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


class _CudaView:
    """Registered host memory as a CUDA array (with UVA the device address is the host address)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def wait_for_pool(path: str, timeout_s: float) -> int:
    """The kv_host process creates the files as the graph starts: wait for ours; its size."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the host KV pool {path} did not appear within {timeout_s:.0f}s (is kv_host up?)")
        time.sleep(0.05)
    return os.path.getsize(path)


def _unregister(ptrs: list[int]) -> None:
    # before the mapping goes: a later mmap at the same address would find it still registered (error 712)
    while ptrs:
        torch.cuda.cudart().cudaHostUnregister(ptrs.pop())


class HostKvPool:
    """`peers` (cache.dp_fetch): dp replica → its pool file for this tp rank, read by fetch moves.
    Its registrations end with `close()` or when the pool is collected, whichever comes first."""

    def __init__(self, kv: KvCache, path: str, num_slots: int, device: torch.device, timeout_s: float = 300.0,
                 peers: Optional[dict[int, str]] = None):
        self.kv = kv
        self.device = device
        self.num_slots = num_slots
        self._mapped: list[torch.Tensor] = []
        self._registered: list[int] = []
        self._unregister = weakref.finalize(self, _unregister, self._registered)
        self.stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = self._map(path, timeout_s)
        self.peers = {d: self._map(p, timeout_s) for d, p in (peers or {}).items()}

    def _map(self, path: str, timeout_s: float) -> torch.Tensor:
        kv, num_slots, device = self.kv, self.num_slots, self.device
        layers, heads, dim = len(kv.k), kv.k[0].shape[1], kv.k[0].shape[2]
        shape = (2, layers, num_slots, heads, dim)
        need = 2 * layers * num_slots * heads * dim * kv.k[0].element_size()
        have = wait_for_pool(path, timeout_s)
        if have < need:
            raise RuntimeError(f"host KV pool {path} holds {have} bytes; {num_slots} slots of this rank's KV need {need}")
        mapped = torch.from_file(path, shared=True, size=need, dtype=torch.uint8)  # MAP_SHARED
        self._mapped.append(mapped)
        if device.type == "cuda":
            ptr = mapped.data_ptr()
            err = torch.cuda.cudart().cudaHostRegister(ptr, need, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the host KV pool ({need} bytes) failed: error {int(err)}")
            self._registered.append(ptr)
            raw = torch.as_tensor(_CudaView(ptr, need), device=device)
        else:
            raw = mapped
        return raw.view(kv.k[0].dtype).view(shape)

    def close(self) -> None:
        """Unregister and unmap the pools (the copies in flight finish first)."""
        if self.stream is not None:
            self.stream.synchronize()
        self._unregister()
        self.pool = None
        self.peers = {}
        self._mapped.clear()

    @torch.inference_mode()
    def apply(self, moves: list[KvMove]) -> None:
        """Copy in list order; on a GPU enqueue on the side stream and make the current stream wait."""
        if not moves:
            return
        if self.stream is None:
            self._copy(moves)
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self._copy(moves)
        compute.wait_stream(self.stream)

    def _copy(self, moves: list[KvMove]) -> None:
        kv = self.kv
        for move in moves:
            pool = self.pool if move.replica < 0 else self.peers[move.replica]  # a fetch reads another replica's
            gpu = torch.tensor(move.gpu_slots, dtype=torch.int64).to(self.device, non_blocking=True)
            host = torch.tensor(move.host_slots, dtype=torch.int64).to(self.device, non_blocking=True)
            for layer in range(len(kv.k)):
                for side, cache in ((0, kv.k[layer]), (1, kv.v[layer])):
                    if move.to_host:
                        pool[side, layer].index_copy_(0, host, cache.index_select(0, gpu))
                    else:
                        cache.index_copy_(0, gpu, pool[side, layer].index_select(0, host))
