"""The dot products of a one-row linear layer's program: its rows of W against x, walking K tile by
tile with the next weight tiles in flight (the batch-1 GEMV and the fused qkv + rotary kernel)."""
from __future__ import annotations

import triton
import triton.language as tl

from llaunch.kernels.pdl_wait import wait_for_previous_kernel


@triton.jit
def row_dots(x_ptr, w_rows, row_mask, K, up_offset, norm_ptr, eps, res_rows, GATED: tl.constexpr,
             NORM: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """Σ_k w[r, k]·x[k] in float32 for a program's rows (w_rows: a pointer per row), and for the rows
    up_offset further when GATED. Shared by every one-row kernel, so all walk K tile by tile alike;
    the compiler still lays out each kernel's tile, and so its final in-tile sum, on its own.

    NORM: x is taken through RMSNorm with weight norm_ptr on the way: the sums are of w·(x·g) times
    rsqrt(mean(x²) + eps), with x² summed in the same walk, so no program waits on a reduction of x
    before its first multiply (the norm's bf16 roundings of x·r and of ·g are not made). RESIDUAL:
    also returns the values at res_rows (a pointer per row), loaded as soon as the wait returns.
    (Two tiles in flight, each summed to its rows as it is used, measured slower on an H200 at every
    launch shape tried: docs/benchmarks.md.)"""
    cols = tl.arange(0, BLOCK_K)
    # Software pipelining by one tile: tile k+1's loads are in flight while tile k is summed. The
    # first tile is requested before the PDL wait: weights are constants, x is the previous kernel's.
    mask = row_mask[:, None] & (cols < K)[None, :]
    w = tl.load(w_rows[:, None] + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    up = w
    if GATED:
        up = tl.load(w_rows[:, None] + up_offset + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    residual = tl.zeros([BLOCK_N], dtype=tl.float32)
    if RESIDUAL:
        residual = tl.load(res_rows, mask=row_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * tl.load(norm_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        nxt = k0 + BLOCK_K + cols
        mask = row_mask[:, None] & (nxt < K)[None, :]  # all false after the last tile: no traffic
        w_next = tl.load(w_rows[:, None] + nxt[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
        if GATED:
            up_next = tl.load(w_rows[:, None] + up_offset + nxt[None, :], mask=mask, other=0.0,
                              eviction_policy="evict_first")
            up_acc += up.to(tl.float32) * x[None, :]
            up = up_next
    y = tl.sum(acc, axis=1)
    up_y = tl.sum(up_acc, axis=1)
    if NORM:
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        y = y * rstd
        up_y = up_y * rstd
    return y, up_y, residual
