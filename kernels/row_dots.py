"""The dot products of a one-row linear layer's program: its rows of W against x, walking K tile by
tile with the next weight tiles in flight (the batch-1 GEMV and the fused qkv + rotary kernel)."""
from __future__ import annotations

import triton
import triton.language as tl

from llaunch.kernels.pdl_wait import wait_for_previous_kernel


@triton.jit
def _prefetch_tile_to_l2(w_rows, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Ask L2 for the 128-byte lines of one weight tile (columns k0 … k0 + BLOCK_K of the rows):
    `prefetch.global.L2` returns nothing and nothing waits for it. Columns past K are clamped."""
    lines: tl.constexpr = (BLOCK_K + LINE_ELEMS - 1) // LINE_ELEMS
    cols = tl.minimum(k0 + tl.arange(0, lines) * LINE_ELEMS, K - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [w_rows[:, None] + cols[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def row_dots(x_ptr, w_rows, row_mask, K, up_offset, GATED: tl.constexpr, PDL: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, L2_AHEAD: tl.constexpr = 0,
             LINE_ELEMS: tl.constexpr = 64):
    """Σ_k w[r, k]·x[k] in float32 for a program's rows (w_rows: a pointer per row), and for the rows
    up_offset further when GATED. Shared by every one-row kernel, so all walk K tile by tile alike;
    the compiler still lays out each kernel's tile, and so its final in-tile sum, on its own.
    (Two tiles in flight, each summed to its rows as it is used, measured slower on an H200 at every
    launch shape tried: docs/benchmarks.md, run 4 of the third session.)
    L2_AHEAD > 0 (GPU builds only: inline PTX): before the PDL wait, also ask L2 for the next
    L2_AHEAD tiles (LINE_ELEMS weight elements a 128-byte line), so the first loads after the wait
    need not go to DRAM; it costs no registers, unlike tiles in flight."""
    cols = tl.arange(0, BLOCK_K)
    # Software pipelining by one tile: tile k+1's loads are in flight while tile k is summed. The
    # first tile is requested before the PDL wait: weights are constants, x is the previous kernel's.
    mask = row_mask[:, None] & (cols < K)[None, :]
    w = tl.load(w_rows[:, None] + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    up = w
    if GATED:
        up = tl.load(w_rows[:, None] + up_offset + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    for t in tl.static_range(1, L2_AHEAD + 1):
        _prefetch_tile_to_l2(w_rows, t * BLOCK_K, K, BLOCK_N, BLOCK_K, LINE_ELEMS)
        if GATED:
            _prefetch_tile_to_l2(w_rows + up_offset, t * BLOCK_K, K, BLOCK_N, BLOCK_K, LINE_ELEMS)
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
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
    return tl.sum(acc, axis=1), tl.sum(up_acc, axis=1)
