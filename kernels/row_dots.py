"""The dot products of a one-row linear layer's program: its rows of W against x, walking K tile by
tile with the next weight tiles in flight (the batch-1 GEMV and the fused qkv + rotary kernel)."""
from __future__ import annotations

import triton
import triton.language as tl

from llaunch.kernels.e4m3 import quantized, row_scale
from llaunch.kernels.pdl_wait import wait_for_previous_kernel


@triton.jit
def row_dots(x_ptr, w_rows, row_mask, K, up_offset, GATED: tl.constexpr, PDL: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_AHEAD: tl.constexpr = False, x_scale=1.0,
             QUANT_X: tl.constexpr = False, INTERPRETED: tl.constexpr = False, ROW_SCALE: tl.constexpr = False,
             scale_ub=0.0, HAS_UB: tl.constexpr = False, AMAX_BLOCK: tl.constexpr = 1024):
    """Σ_k w[r, k]·x[k] in float32 for a program's rows (w_rows: a pointer per row), and for the rows
    up_offset further when GATED. Shared by every one-row kernel, so all walk K tile by tile alike;
    the compiler still lays out each kernel's tile, and so its final in-tile sum, on its own.
    (Two tiles in flight, each summed to its rows as it is used, measured slower on an H200 at every
    launch shape tried: docs/performance.md.)
    X_AHEAD: x's next tile is requested with the weights' next tile, instead of at the top of the
    iteration that uses it (same values, same order: bit-identical sums).
    QUANT_X: each x value is first divided by x_scale and rounded to e4m3 (an fp8 layer's activations; the
    sums are then of the e4m3 values, to be multiplied by x_scale). ROW_SCALE: x_scale is x's dynamic
    scale instead (e4m3.row_scale: its absmax over all of K, AMAX_BLOCK columns a load), taken after the
    PDL wait while the first weight tiles are in flight. Returns the sums and the x_scale used."""
    cols = tl.arange(0, BLOCK_K)
    # Software pipelining by one tile: tile k+1's loads are in flight while tile k is summed. The
    # first tile is requested before the PDL wait: weights are constants, x is the previous kernel's.
    mask = row_mask[:, None] & (cols < K)[None, :]
    w = tl.load(w_rows[:, None] + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    up = w
    if GATED:
        up = tl.load(w_rows[:, None] + up_offset + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    if ROW_SCALE:  # x is the previous kernel's and small (in L2): every program takes its absmax
        x_scale = row_scale(x_ptr, K, scale_ub, HAS_UB, AMAX_BLOCK)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if X_AHEAD:
        x_next = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        nxt = k0 + BLOCK_K + cols
        if X_AHEAD:
            x = x_next
            x_next = tl.load(x_ptr + nxt, mask=nxt < K, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        if QUANT_X:
            x = quantized(x, x_scale, INTERPRETED)
        mask = row_mask[:, None] & (nxt < K)[None, :]  # all false after the last tile: no traffic
        w_next = tl.load(w_rows[:, None] + nxt[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
        if GATED:
            up_next = tl.load(w_rows[:, None] + up_offset + nxt[None, :], mask=mask, other=0.0,
                              eviction_policy="evict_first")
            up_acc += up.to(tl.float32) * x[None, :]
            up = up_next
    return tl.sum(acc, axis=1), tl.sum(up_acc, axis=1), x_scale
