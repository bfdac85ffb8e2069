"""Pull a tensor into L2 from inside a latency-bound kernel, for the kernel that runs next.

A batch-1 decode step streams weights at the memory's read rate except while attention runs: a few
microseconds that read a few MB of KV and leave the bus idle. The o_proj weight that follows (26 MB
for Qwen2-7B) fits in an H200's 50 MB L2, so the attention programs request it, one 128-byte line per
thread and instruction (`prefetch.global.L2`: no register result, nothing waits on it), and the
o_proj GEMV then reads it from L2. Only for a GPU build: the interpreter has no inline PTX.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

# LLAUNCH_L2_PREFETCH=0 turns it off (A/B timing).
ENABLED = os.environ.get("LLAUNCH_L2_PREFETCH", "1") != "0"
LINE = 128  # bytes per L2 line


@triton.jit
def prefetch_share(ptr, n_lines, part, parts, BLOCK: tl.constexpr):
    """Prefetch this program's share (part of parts) of n_lines 128-byte lines starting at ptr (an
    int8 pointer). Lines past the end are clamped to the last one: repeats cost nothing."""
    per_part = (n_lines + parts - 1) // parts
    first = part * per_part
    for i in range(first, first + per_part, BLOCK):
        lines = tl.minimum(i + tl.arange(0, BLOCK), n_lines - 1).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr + lines * 128],
                                  dtype=tl.int32, is_pure=False, pack=1)


def lines_to_prefetch(t: Optional[torch.Tensor]) -> int:
    """How many leading 128-byte lines of t to pull into L2 (0: none): at most half the L2, so the
    lines stay until they are read; only a contiguous CUDA tensor, only with the switch on."""
    if t is None or not ENABLED or not t.is_cuda or not t.is_contiguous() or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    l2 = torch.cuda.get_device_properties(t.device).L2_cache_size
    return min(t.numel() * t.element_size(), l2 // 2) // LINE
