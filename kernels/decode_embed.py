"""The start of a decode graph in one kernel: each row's new slot recorded in the slot table, its last
sampled token read, and that token's embedding gathered. As torch ops these were four kernels (a
cast, an index write, an index read, the embedding lookup: ~9 µs of a batch-1 step on an H200)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # embedding columns a program copies


@triton.jit
def _decode_embed_kernel(rows_ptr, positions_ptr, slots_ptr, req_to_slots_ptr, slots_row_stride, last_token_ptr,
                         embed_ptr, embed_stride, out_ptr, hidden, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    part = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    if part == 0:
        slot = tl.load(slots_ptr + i)
        pos = tl.load(positions_ptr + i)
        tl.store(req_to_slots_ptr + row * slots_row_stride + pos, slot.to(req_to_slots_ptr.dtype.element_ty))
    token = tl.load(last_token_ptr + row)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    values = tl.load(embed_ptr + token * embed_stride + cols, mask=mask)
    tl.store(out_ptr + i.to(tl.int64) * hidden + cols, values, mask=mask)


def decode_embed(rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, req_to_slots: torch.Tensor,
                 last_token: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """req_to_slots[rows, positions] = slots; returns embed[last_token[rows]] [B, H]."""
    batch, hidden = rows.shape[0], embed.shape[1]
    out = torch.empty((batch, hidden), dtype=embed.dtype, device=embed.device)
    if batch == 0:
        return out
    assert embed.stride(1) == 1 and req_to_slots.stride(1) == 1
    _decode_embed_kernel[(batch, triton.cdiv(hidden, BLOCK))](
        rows, positions, slots, req_to_slots, req_to_slots.stride(0), last_token, embed, embed.stride(0), out, hidden,
        BLOCK=BLOCK, num_warps=4)
    return out
