"""A candidate for kernels/fp8_gated_quant.py, timed against it by scripts/bench_gated_quant.py: the one-pass
gated quantize as a persistent kernel whose next row's loads are in flight while it computes this one.

The served kernel runs a program of 32 warps a row, one an SM (64 registers a thread), so an SM's loads and its
arithmetic take turns: 101 µs at 2,010 rows of Qwen2-7B's 18,944 columns on an H100, 1.89 TB/s. Here each SM's
program walks rows (row = program, program + programs, ...) and Triton's loop pipeliner copies the next row's
gate, up and channel scales into shared memory (cp.async) while this row's values are computed from registers.
One row's stage must fit an SM's shared memory (227 KB on Hopper): its columns as up to three power-of-two blocks
that hold them exactly (18,944 = 16,384 + 2,048 + 512: 222 KB with the float32 channel scales; the served
kernel's 16,384 + 4,096 would take 246 KB). Same roundings and bytes as the served kernel (the row's own absmax
scale, no static scale nor scale_ub), checked in the interpreter (tests/kernels/test_gated_quant_candidate.py)
and by the bench on the GPU. If it wins there, it moves into kernels/.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels.e4m3 import e4m3_of
from llaunch.kernels.fp8_gated_quant import _DTYPES, _activated, _row_scale

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_BLOCKS = 3
SHARED_BYTES = 227 * 1024  # Hopper's shared memory a block (opt-in): a row's stage must fit it


@triton.jit
def _part(y_row, rs, cs_ptr, k0, inner, amax, SCALED: tl.constexpr, ACT: tl.constexpr, DTYPE: tl.constexpr,
          BLOCK: tl.constexpr):
    """act(gate) · up of columns k0 .. k0 + BLOCK and the row's absmax so far."""
    h, mask = _activated(y_row, rs, cs_ptr, k0, inner, SCALED, ACT, DTYPE, BLOCK)
    return h, mask, tl.maximum(amax, tl.max(tl.where(mask, tl.abs(h), 0.0), axis=0))


@triton.jit
def _gated_quant_rows_kernel(y_ptr, rs_ptr, cs_ptr, q_ptr, s_ptr, M, inner, stride_y, stride_q,
                             SCALED: tl.constexpr, ACT: tl.constexpr, DTYPE: tl.constexpr, B0: tl.constexpr,
                             B1: tl.constexpr, B2: tl.constexpr, STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        r = tl.cast(row, tl.int64)
        y_row = y_ptr + r * stride_y
        q_row = q_ptr + r * stride_q
        rs = 1.0
        if SCALED:
            rs = tl.load(rs_ptr + r)
        h0, m0, amax = _part(y_row, rs, cs_ptr, 0, inner, 0.0, SCALED, ACT, DTYPE, B0)
        if B1 > 0:
            h1, m1, amax = _part(y_row, rs, cs_ptr, B0, inner, amax, SCALED, ACT, DTYPE, B1)
        if B2 > 0:
            h2, m2, amax = _part(y_row, rs, cs_ptr, B0 + B1, inner, amax, SCALED, ACT, DTYPE, B2)
        scale = _row_scale(amax, s_ptr, 0.0, False, False)
        tl.store(s_ptr + r, scale)
        tl.store(q_row + tl.arange(0, B0), e4m3_of(h0, scale, True, INTERPRETED), mask=m0)
        if B1 > 0:
            tl.store(q_row + B0 + tl.arange(0, B1), e4m3_of(h1, scale, True, INTERPRETED), mask=m1)
        if B2 > 0:
            tl.store(q_row + B0 + B1 + tl.arange(0, B2), e4m3_of(h2, scale, True, INTERPRETED), mask=m2)


def exact_blocks(inner: int) -> tuple[int, int, int]:
    """`inner` columns as at most three power-of-two blocks, largest first, the last rounded up where the binary
    digits run out (zeros: no block)."""
    blocks, rest = [], inner
    while rest and len(blocks) < MAX_BLOCKS - 1:
        blocks.append(1 << (rest.bit_length() - 1))
        rest -= blocks[-1]
    if rest:
        blocks.append(triton.next_power_of_2(rest))
    return tuple(blocks + [0] * (MAX_BLOCKS - len(blocks)))


def stage_bytes(inner: int, itemsize: int, scaled: bool) -> int:
    """Shared memory a row's stage takes: gate and up, with their float32 channel scales when scaled."""
    return sum(exact_blocks(inner)) * 2 * (itemsize + (4 if scaled else 0))


def gated_quantize_pipelined(y: torch.Tensor, dtype: torch.dtype, row_scales: Optional[torch.Tensor] = None,
                             channel_scales: Optional[torch.Tensor] = None, act: int = 0, programs: int = 0,
                             stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.fp8_gated_quant.gated_quantize with each row's own absmax scale, through the persistent kernel:
    `programs` of them (0: one an SM), the next row's loads `stages` - 1 rows ahead."""
    if y.dim() != 2 or y.stride(-1) != 1 or y.shape[1] % 2:
        raise ValueError(f"gated_quantize takes [M, 2I] with contiguous rows, got {tuple(y.shape)} strides {y.stride()}")
    if (row_scales is None) != (channel_scales is None):
        raise ValueError("row_scales and channel_scales come together (the unscaled sums) or not at all")
    m, inner = y.shape[0], y.shape[1] // 2
    scaled = row_scales is not None
    held = (stages - 1) * stage_bytes(inner, y.element_size(), scaled)  # the rows in flight (an offline sm_90 build)
    if y.is_cuda and held > SHARED_BYTES:
        raise ValueError(f"{stages - 1} rows of {inner} columns in flight take {held} bytes of shared memory, more "
                         f"than {SHARED_BYTES}")
    q = torch.empty((m, inner), dtype=torch.float8_e4m3fn, device=y.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=y.device)
    if m == 0 or inner == 0:
        return q, scales
    if not programs:
        programs = torch.cuda.get_device_properties(y.device).multi_processor_count if y.is_cuda else 2
    b0, b1, b2 = exact_blocks(inner)
    _gated_quant_rows_kernel[(min(m, programs),)](
        y, row_scales.reshape(-1).float().contiguous() if scaled else scales,
        channel_scales.float().contiguous() if scaled else scales, q, scales, m, inner, y.stride(0), q.stride(0),
        SCALED=scaled, ACT=act, DTYPE=_DTYPES[dtype], B0=b0, B1=b1, B2=b2, STAGES=stages, INTERPRETED=_INTERPRETED,
        num_warps=min(32, max(4, triton.next_power_of_2((b0 + b1 + b2) // 1024))))
    return q, scales
