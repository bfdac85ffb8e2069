"""Arrival counters of the split-K kernels (kernels/gemv_fp8.py, kernels/skinny_gemm.py): a program per share of
K stores its float32 partial sums, counts its arrival at its output tile with an atomic, and the tile's last
program adds the partials and writes the result. One counter per output tile, zero between launches: each
launch's last programs reset their tiles'. The kernels share the buffer: every launch waits for the previous
kernel to finish (PDL's wait comes first) before its first atomic.
"""
from __future__ import annotations

import torch
import triton

# Per device; grown outside CUDA-graph capture only; a grown-out buffer is kept alive, as graphs captured earlier
# still address it.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` int32 zeros on `device` (the buffer held since a launch needed as many)."""
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K: {tiles} arrival counters first needed inside a CUDA-graph capture "
                               "(the warm-up before it allocates them)")
        held.append(torch.zeros(max(4096, triton.next_power_of_2(tiles)), dtype=torch.int32, device=device))
    return held[-1]
