"""Arrival counters of the split-K kernels (kernels/gemv_fp8.py, kernels/skinny_gemm.py): a program per share of
K stores its float32 partial sums, counts its arrival at its output tile with an atomic, and the tile's last
program adds the partials and writes the result. One counter per output tile, zero between launches: each
launch's last programs reset their tiles'. The kernels share the buffer: every launch waits for the previous
kernel to finish (PDL's wait comes first) before its first atomic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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


@triton.jit
def k_share(K, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """(k_begin, k_end) of this program's share of K, program_id(1) of SPLIT: whole BLOCK_K tiles, the last shares
    possibly empty; all of K when SPLIT is 1."""
    k_begin = 0
    k_end = K
    if SPLIT > 1:
        per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
        k_begin = tl.program_id(1) * per_split
        k_end = tl.minimum(k_begin + per_split, K)
    return k_begin, k_end


@triton.jit
def arrive(count_ptr, tile, SPLIT: tl.constexpr):
    """Called once this program's partial sums are stored: counts its arrival at `tile`'s counter and returns whether
    it came last; the last one resets the counter and may read every share's partials (with .cg loads: other SMs
    wrote them, past this SM's L1)."""
    tl.debug_barrier()  # every thread's partial stored before the arrival is counted (a release at GPU scope)
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT - 1
    if last:
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero for the next launch
    return last


@triton.jit
def added_shares(acc, parts, share_stride, mask, count_ptr, tile, SPLIT: tl.constexpr):
    """Stores this program's partial sums `acc` (float32) at `parts` (share 0's pointers, a share `share_stride`
    elements further each), counts its arrival at `tile`, and returns (the shares' sum in split order, whoever arrived
    last: the same bits whatever the order of arrival; whether this program came last and so owns the tile's output)."""
    tl.store(parts + tl.program_id(1) * share_stride, acc, mask=mask)
    last = arrive(count_ptr, tile, SPLIT)
    total = tl.zeros_like(acc)
    if last:
        for share in tl.static_range(SPLIT):
            total += tl.load(parts + share * share_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total, last
