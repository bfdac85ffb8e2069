"""The one-row fp8 linear layer (e4m3 weights with per-channel scales) on the tensor cores.

kernels/gemv.py's register kernel converts every e4m3 weight to float32 and multiplies it on the CUDA
cores: as many instructions a weight as for bf16, for half the bytes. On an H200 its fp8 GEMVs took as
long a layer as bf16's (1.6-2.0 TB/s, scripts/bench_decode_shapes.py --fp8 --per-kind). Here x's row
is quantized once per tile and padded to the 16 rows of an MMA (15 zero rows), and each program multiplies its BLOCK_N weight rows by it with tl.dot (e4m3 × e4m3, float32 accumulation),
the weight tiles pipelined into shared memory STAGES deep by Triton's loop pipeliner. The CUDA cores do
only x's quantization (shared by the program's rows) and the epilogue.

SWAP_AB (kernels.fp8_swap_ab names the weight shapes): the weight tiles come by TMA into shared memory (a
descriptor, as kernels/gemv_staged.py's) and are the MMA's A operand there, x's row the first of B's 16 columns,
instead of x the first of A's 16 rows: a BLOCK_N of 64 fills a Hopper warpgroup MMA (wgmma, e4m3 × e4m3) that reads
the weights where the copy put them, where the unswapped dot of 16 rows builds to mma.sync on operands in registers
(vLLM's CUTLASS fp8 GEMMs swap A and B for few rows too).

A narrow layer (o_proj, down_proj: N / BLOCK_N programs, fewer than an H200 has SMs) splits K over SPLIT
programs a tile: each stores its float32 partial sums, and the tile's last program to finish (a counter per
tile, taken and reset by atomics) adds the SPLIT partials in split order (the result does not depend on which
program ends last) and applies the epilogue: no second kernel.

Same arithmetic as gemv.py's fp8 path up to the order of the sum: x divided by its scale (the row's
absmax / 448, or the static scale) and rounded to e4m3, products of e4m3 values summed in float32, the sum
times the channel's and the row's scales, then the bias; gated: silu(gate) · up rounded as the unfused
path rounds.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from llaunch.kernels.e4m3 import quantized, row_scale
from llaunch.kernels.pdl_wait import wait_for_previous_kernel
from llaunch.kernels.split_k import added_shares, counters, k_share

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
@triton.jit
def _tile_dot(xq, w, INTERPRETED: tl.constexpr):
    """[16, BLOCK_K] · [BLOCK_N, BLOCK_K]ᵀ in float32; e4m3 operands on the GPU (the interpreter's dot
    takes float32: the values are e4m3's, so the products are the same)."""
    if INTERPRETED:
        return tl.dot(xq, tl.trans(w.to(tl.float32)))
    return tl.dot(xq.to(tl.float8e4nv), tl.trans(w), out_dtype=tl.float32)


@triton.jit
def _swapped_tile_dot(w, xq_t, INTERPRETED: tl.constexpr):
    """[BLOCK_N, BLOCK_K] · [BLOCK_K, 16] in float32: the weight tile as the MMA's A operand (SWAP_AB)."""
    if INTERPRETED:
        return tl.dot(w.to(tl.float32), xq_t)
    return tl.dot(w, xq_t.to(tl.float8e4nv), out_dtype=tl.float32)


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, b_ptr, out_ptr, part_ptr, count_ptr, N, K, w_stride, up_offset,
                     scale_ub, DYNAMIC: tl.constexpr, HAS_UB: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, SPLIT: tl.constexpr, AMAX_BLOCK: tl.constexpr, SWAP_AB: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    tile = tl.program_id(0)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    if not SWAP_AB:  # else w_ptr is a TMA descriptor of the weight
        w_rows = w_ptr + rows.to(tl.int64) * w_stride
    cols = tl.arange(0, BLOCK_K)
    # an MMA's smallest M (N under SWAP_AB) is 16: x's row (column), then 15 zero ones
    first = tl.arange(0, 16)[:, None] == 0
    first_col = tl.arange(0, 16)[None, :] == 0
    wait_for_previous_kernel(PDL)  # x is the previous kernel's
    if DYNAMIC:  # the row's absmax over all of K (x is small, in L2)
        x_scale = row_scale(x_ptr, K, scale_ub, HAS_UB, AMAX_BLOCK)
    else:
        x_scale = tl.load(xs_ptr)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        up_acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    else:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        up_acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    k_begin, k_end = k_share(K, BLOCK_K, SPLIT)
    # x one tile ahead: the pipeliner stages the weight tiles (they feed the dot) but x reaches the dot
    # through the quantization, so without this every iteration waits an L2 round trip for its x
    x_next = tl.load(x_ptr + k_begin + cols, mask=k_begin + cols < k_end, other=0.0)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        k_mask = k0 + cols < k_end
        x = x_next.to(tl.float32)
        x_next = tl.load(x_ptr + k0 + BLOCK_K + cols, mask=k0 + BLOCK_K + cols < k_end, other=0.0)
        if SWAP_AB:
            # the TMA copies zeros past the weight's rows and K; a share's tiles end where the next one's begin
            # (whole tiles: k_share), and x's columns past k_end are zeros; a gate tile past N reads up rows (not
            # stored)
            xq_t = tl.where(first_col, quantized(x, x_scale, INTERPRETED)[:, None], 0.0)
            acc += _swapped_tile_dot(w_ptr.load([tile * BLOCK_N, k0]), xq_t, INTERPRETED)
            if GATED:
                up_acc += _swapped_tile_dot(w_ptr.load([N + tile * BLOCK_N, k0]), xq_t, INTERPRETED)
        else:
            mask = row_mask[:, None] & k_mask[None, :]
            w = tl.load(w_rows[:, None] + k0 + cols[None, :], mask=mask, other=0.0)
            xq = tl.where(first, quantized(x, x_scale, INTERPRETED)[None, :], 0.0)
            acc += _tile_dot(xq, w, INTERPRETED)
            if GATED:
                up = tl.load(w_rows[:, None] + up_offset + k0 + cols[None, :], mask=mask, other=0.0)
                up_acc += _tile_dot(xq, up, INTERPRETED)
    if SWAP_AB:  # columns 1-15 are zeros
        y = tl.sum(acc, axis=1)
        up_sum = tl.sum(up_acc, axis=1)
    else:  # rows 1-15 are zeros
        y = tl.sum(acc, axis=0)
        up_sum = tl.sum(up_acc, axis=0)
    last = True
    if SPLIT > 1:  # (never GATED: gemv_fp8 refuses it) the partial sums, then the tile's last program adds them
        y, last = added_shares(y, part_ptr + rows, N, row_mask, count_ptr, tile, SPLIT)
    if last:
        _epilogue(y, up_sum, x_ptr, s_ptr, b_ptr, out_ptr, rows, row_mask, N, x_scale, HAS_BIAS, GATED)


@triton.jit
def _epilogue(y, up_y, x_ptr, s_ptr, b_ptr, out_ptr, rows, row_mask, N, x_scale, HAS_BIAS: tl.constexpr,
              GATED: tl.constexpr):
    """A tile's float32 sums of e4m3 products → out: the channel's and the row's scales, the bias; gated:
    silu(gate) · up."""
    y = y * (tl.load(s_ptr + rows, mask=row_mask, other=0.0) * x_scale)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        # Round as the unfused path does: linear output to the dtype, silu(gate) to the dtype.
        gate = y.to(dtype).to(tl.float32)
        up_y = up_y * (tl.load(s_ptr + N + rows, mask=row_mask, other=0.0) * x_scale)
        up_y = up_y.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * up_y
    # a float32 output still holds the input dtype's rounding, as gemv.py's kernel stores it
    tl.store(out_ptr + rows, y.to(x_ptr.dtype.element_ty).to(dtype), mask=row_mask)


def gemv_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, input_scale, scale_ub, bias,
             out: torch.Tensor, n: int, gated: bool, dynamic: bool, pdl_flavor: int, block_n: int, block_k: int, warps: int,
             stages: int, amax_block: int, split: int = 1, swap_ab: bool = False) -> None:
    """out [1, n] = the fp8 layer (weight e4m3 [N or 2n, K], scale [N] float32) applied to x [1, K], or
    SiLU-gated over weight = gate‖up; checked by gemv(). dynamic: x's scale from its absmax (clipped to
    scale_ub where given), else input_scale. pdl_flavor: pdl.flavor()'s value, 0 for a launch without PDL.
    split > 1: K over that many programs a tile (ungated layers). swap_ab: the weight tile as the MMA's A operand."""
    if split > 1 and gated:
        raise ValueError("gemv_fp8: a split of K is for ungated layers (gate‖up has programs enough)")
    k = weight.shape[1]
    tiles = triton.cdiv(n, block_n)
    parts = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else out
    counts = counters(x.device, tiles) if split > 1 else out
    if swap_ab:  # the weight tiles by TMA into shared memory, the MMA's A operand there
        weight_arg = TensorDescriptor(weight, shape=list(weight.shape), strides=[weight.stride(0), 1],
                                      block_shape=[block_n, block_k])
    _gemv_fp8_kernel[(tiles, split)](
        x, weight_arg if swap_ab else weight, scale, input_scale if input_scale is not None else scale, bias if bias is not None else x, out,
        parts, counts, n, k, weight.stride(0), n * weight.stride(0), scale_ub or 0.0, DYNAMIC=dynamic,
        HAS_UB=dynamic and scale_ub is not None, HAS_BIAS=bias is not None, GATED=gated, PDL=pdl_flavor,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT=split, AMAX_BLOCK=amax_block,
        SWAP_AB=swap_ab, INTERPRETED=_INTERPRETED, num_warps=warps, launch_pdl=bool(pdl_flavor))
