"""An fp8 (e4m3) KV cache: K and V quantized on store with one float32 scale per layer each, read back
dequantized (value × scale in the model's dtype). Optionally records each layer's K/V absmax as tokens
are stored (calibration: runtime/models/kv_fp8.py turns it into scales).

The references here serve every device: the store is an indexed write, the attention references read
the cache through `Dequantizing`, which dequantizes only the slots a request reads.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from llaunch.kernels.fp8 import FP8, to_fp8


class KvScales(NamedTuple):
    """One layer's: K and V scales ([] float32), and absmax accumulators when calibrating."""

    k: torch.Tensor
    v: torch.Tensor
    k_amax: Optional[torch.Tensor] = None
    v_amax: Optional[torch.Tensor] = None


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             scales: KvScales) -> None:
    """k, v [T, Hk, D] → e4m3 at their layer's scales into slots [T]; absmax recorded when calibrating
    (on the device, no sync: a running max)."""
    if scales.k_amax is not None and k.numel():
        torch.maximum(scales.k_amax, k.abs().amax().float(), out=scales.k_amax)
        torch.maximum(scales.v_amax, v.abs().amax().float(), out=scales.v_amax)
    # through byte views: every torch build indexes uint8 (float8 index kernels came late to some)
    k_cache.view(torch.uint8)[slots] = to_fp8(k, scales.k).view(torch.uint8)
    v_cache.view(torch.uint8)[slots] = to_fp8(v, scales.v).view(torch.uint8)


class Dequantizing:
    """An fp8 cache seen as the model's dtype: indexing it returns dequantized slots."""

    def __init__(self, cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        assert cache.dtype == FP8, cache.dtype
        self.cache, self.scale, self.dtype = cache, scale, dtype

    @property
    def shape(self):
        return self.cache.shape

    def __getitem__(self, index) -> torch.Tensor:
        return (self.cache.view(torch.uint8)[index].view(FP8).float() * self.scale).to(self.dtype)
