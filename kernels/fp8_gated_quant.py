"""An fp8 MLP's middle in one kernel: the gate‖up GEMM's sums → (the row × channel scales) → act(gate) · up →
down_proj's activations in e4m3 with one scale per token. Unfused, at a step of ~2,000 tokens these are three
kernels over the [M, 2I] and [M, I] tensors (fp8_epilogue, gated_activation, fp8_rows: ~700 MB of traffic a
Qwen2-7B layer, 6.6 ms of a 35 ms c256-like mixed step on an H100 with the other layers' scales and
quantizations); here only e4m3 is written, and a row of up to ROW_IN_REGISTERS columns is read once: a program
holds it whole (the absmax, then its e4m3 values from registers). A wider row is read twice in tiles (the
absmax, then the values). The two-pass tiles took 29 µs a Qwen2-7B layer at 158 rows on an H100 (0.6 TB/s: 158
programs of 4 warps cannot keep HBM busy) and 134 µs at 2,010 (its second pass mostly not from L2).
The roundings are the unfused kernels', in their order: the scaled sums to the model's dtype, the activation to
it, the product to it, then kernels/fp8_rows.py's scale and e4m3.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels.e4m3 import e4m3_of, scale_of_absmax

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024  # a tile of the two-pass kernel (rows wider than ROW_IN_REGISTERS)
# The most lanes one program holds (row_blocks' two blocks): ≤ 24 values a thread of 32 warps. An sm_90a build
# (Triton 3.9) of 16,384 + 4,096 lanes took 41-62 registers, of 16,384 + 16,384 58-64: at the 1,024-thread cap
ROW_IN_REGISTERS = 24576
# A one-pass program's warps (at most): at 32 the sm_90 build takes 64 registers a thread, one program an SM
ONE_PASS_WARPS = 32
_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """float32 x rounded to the model's dtype (0 bfloat16, 1 float16, 2 float32), back in float32."""
    if DTYPE == 0:
        return x.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == 1:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _activated(y_row, rs, cs_ptr, k0, inner, SCALED: tl.constexpr, ACT: tl.constexpr, DTYPE: tl.constexpr,
               BLOCK: tl.constexpr):
    """act(gate) · up of columns k0 .. k0 + BLOCK of one row, as the unfused kernels round it (float32 values)."""
    cols = k0 + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_row + inner + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALED:  # fp8_epilogue: sums · row scale · channel scale, rounded to the model's dtype
        gate = gate * rs * tl.load(cs_ptr + cols, mask=mask, other=0.0)
        up = up * rs * tl.load(cs_ptr + inner + cols, mask=mask, other=0.0)
    gate = _rounded(gate, DTYPE)
    up = _rounded(up, DTYPE)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        g = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # √(2/π) (x + 0.044715 x³)
        e = tl.exp2(-2.8853900817779268 * tl.abs(g))
        t = (1.0 - e) / (1.0 + e)
        act = 0.5 * gate * (1.0 + tl.where(g < 0, -t, t))
    return _rounded(_rounded(act, DTYPE) * up, DTYPE), mask


@triton.jit
def _row_scale(amax, xs_ptr, scale_ub, STATIC: tl.constexpr, HAS_UB: tl.constexpr):
    """The row's e4m3 scale: the static one, or its absmax (clipped to scale_ub) / 448."""
    if STATIC:
        return tl.load(xs_ptr)
    if HAS_UB:
        amax = tl.minimum(amax, scale_ub)
    return scale_of_absmax(amax)


@triton.jit
def _gated_quant_kernel(y_ptr, rs_ptr, cs_ptr, q_ptr, s_ptr, xs_ptr, inner, stride_y, stride_q, scale_ub,
                        SCALED: tl.constexpr, STATIC: tl.constexpr, HAS_UB: tl.constexpr, ACT: tl.constexpr,
                        DTYPE: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr, ONE_PASS: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    OWN_SCALE: tl.constexpr = not STATIC and not HAS_UB  # a row's own absmax scale: e4m3 through its reciprocal
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_y
    q_row = q_ptr + row * stride_q
    rs = 1.0
    if SCALED:
        rs = tl.load(rs_ptr + row)
    if ONE_PASS:  # the whole row in registers, read once: BLOCK columns, then TAIL more (0: none)
        h, mask = _activated(y_row, rs, cs_ptr, 0, inner, SCALED, ACT, DTYPE, BLOCK)
        amax = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=0)
        if TAIL > 0:
            h_tail, tail_mask = _activated(y_row, rs, cs_ptr, BLOCK, inner, SCALED, ACT, DTYPE, TAIL)
            amax = tl.maximum(amax, tl.max(tl.where(tail_mask, tl.abs(h_tail), 0.0), axis=0))
            scale = _row_scale(amax, xs_ptr, scale_ub, STATIC, HAS_UB)
            tl.store(q_row + BLOCK + tl.arange(0, TAIL), e4m3_of(h_tail, scale, OWN_SCALE, INTERPRETED),
                     mask=tail_mask)
        else:
            scale = _row_scale(amax, xs_ptr, scale_ub, STATIC, HAS_UB)
        tl.store(s_ptr + row, scale)
        tl.store(q_row + tl.arange(0, BLOCK), e4m3_of(h, scale, OWN_SCALE, INTERPRETED), mask=mask)
    else:  # tiles: the absmax, then the e4m3 values
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        if not STATIC:
            for k0 in range(0, inner, BLOCK):
                h, mask = _activated(y_row, rs, cs_ptr, k0, inner, SCALED, ACT, DTYPE, BLOCK)
                amax = tl.maximum(amax, tl.where(mask, tl.abs(h), 0.0))
        scale = _row_scale(tl.max(amax, axis=0), xs_ptr, scale_ub, STATIC, HAS_UB)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, inner, BLOCK):
            h, mask = _activated(y_row, rs, cs_ptr, k0, inner, SCALED, ACT, DTYPE, BLOCK)
            tl.store(q_row + k0 + tl.arange(0, BLOCK), e4m3_of(h, scale, OWN_SCALE, INTERPRETED), mask=mask)


def row_blocks(inner: int) -> tuple[int, int]:
    """A row of `inner` columns as two power-of-two blocks a program holds: the largest power of two ≤ inner, then
    the rest rounded up (0: none). Qwen2-7B's 18,944: 16,384 + 4,096 (next_power_of_2 alone: 32,768 lanes, 42% idle)."""
    block = 1 << (inner.bit_length() - 1)
    rest = inner - block
    return block, triton.next_power_of_2(rest) if rest else 0


def gated_quantize(y: torch.Tensor, dtype: torch.dtype, row_scales: Optional[torch.Tensor] = None,
                   channel_scales: Optional[torch.Tensor] = None, scale_ub: Optional[float] = None,
                   static_scale: Optional[torch.Tensor] = None, act: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """y [M, 2I] (gate ‖ up: the GEMM's unscaled sums with row_scales [M] and channel_scales [2I], or already
    scaled) → (e4m3 [M, I], float32 scales [M, 1]) of act(gate) · up in `dtype` (act 0: SiLU, 1: gelu_tanh), each
    row by its absmax / 448 (clipped to scale_ub), or every row by `static_scale`."""
    if y.dim() != 2 or y.stride(-1) != 1 or y.shape[1] % 2:
        raise ValueError(f"gated_quantize takes [M, 2I] with contiguous rows, got {tuple(y.shape)} strides {y.stride()}")
    if (row_scales is None) != (channel_scales is None):
        raise ValueError("row_scales and channel_scales come together (the unscaled sums) or not at all")
    m, inner = y.shape[0], y.shape[1] // 2
    q = torch.empty((m, inner), dtype=torch.float8_e4m3fn, device=y.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=y.device)
    if m and inner:
        scaled, static = row_scales is not None, static_scale is not None
        block, tail = row_blocks(inner)
        one_pass = block + tail <= ROW_IN_REGISTERS
        if not one_pass:
            block, tail = BLOCK, 0
        _gated_quant_kernel[(m,)](
            y, row_scales.reshape(-1).float().contiguous() if scaled else scales,
            channel_scales.float().contiguous() if scaled else scales, q, scales,
            static_scale.float() if static else scales, inner, y.stride(0), q.stride(0), scale_ub or 0.0,
            SCALED=scaled, STATIC=static, HAS_UB=scale_ub is not None and not static, ACT=act, DTYPE=_DTYPES[dtype],
            BLOCK=block, TAIL=tail, ONE_PASS=one_pass, INTERPRETED=_INTERPRETED,
            num_warps=min(ONE_PASS_WARPS, max(4, triton.next_power_of_2((block + tail) // 1024))) if one_pass else 4)
    return q, scales
