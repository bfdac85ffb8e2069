"""Asking the L2 for a one-row layer's weights ahead of its loads (kernels.gemv_l2_prefetch): a program of the batch-1
GEMV walks its rows tile by tile, each load waiting on the one before it, and on a short layer (Qwen2-7B's qkv and
o_proj: 7 tiles a program, every program resident at once) the layer's time is those waits on memory. A Hopper bulk
prefetch (cp.async.bulk.prefetch.L2) asks for a row's next bytes in one instruction, holds no registers for them and
changes no value: the loads after it find the bytes in the L2."""
from __future__ import annotations

import triton
import triton.language as tl

# where $1 is not 0; $0 is a dummy output (an asm has one). The address and size must be uniform across the warp:
# ptxas loops over a warp's distinct rows (a row's pointer is held by every thread of the warp that sums it)
_ASK = tl.constexpr("""{
    .reg .pred p;
    setp.ne.b32 p, $1, 0;
    @p cp.async.bulk.prefetch.L2.global [$2], $3;
    mov.b32 $0, 0;
}""")


@triton.jit
def ask_l2(rows, first, count, row_mask, end, ELEM_BYTES: tl.constexpr):
    """Ask the L2 for `count` elements of each row from element `first` on, those before `end` (whole 16-byte units:
    rows start 16-byte aligned, the host's check): `rows` a [BLOCK_N] pointer a row, ELEM_BYTES an element's size."""
    nbytes = tl.minimum(count, end - first) * ELEM_BYTES // 16 * 16
    issue = (row_mask & (nbytes > 0)).to(tl.int32)
    tl.inline_asm_elementwise(_ASK, "=r,r,l,r", [issue, rows + first, tl.zeros_like(issue) + nbytes],
                              dtype=tl.int32, is_pure=False, pack=1)

