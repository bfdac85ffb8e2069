"""Linear layers of 2-16 rows (verify steps of speculative decoding, small decode batches) on the tensor cores.

A step of a few rows reads every weight once, as batch-1 decode does, and its speed is the weight-read
bandwidth. cuBLAS runs such a product 1.20-1.22x slower than the one-row GEMV runs its row (a batch-1 verify
step of 2-5 tokens against a decode step on an H200, docs/performance.md), and a GEMV of several rows on the CUDA
cores was slower still (kernels/gemv_rows.py, removed). Here x's rows are padded to the 16 rows of an MMA and each
program multiplies its BLOCK_N weight rows by them with tl.dot (float32 accumulation), the weight tiles pipelined
STAGES deep by Triton's loop pipeliner: one pass over the weights for all rows. `gated=True` reads the gate and up
rows of a fused gate‖up weight side by side and writes silu(gate) · up. A narrow layer (o_proj, down_proj: fewer
output tiles than SMs) splits K over SPLIT programs a tile (kernels/split_k.py: the tile's last program adds the
partials in split order).

A row's sums do not depend on the other rows of the launch (each output is its own row of the MMA, summed in K
order); steps of one row or of more than kernels.skinny_rows run other kernels (the GEMV, cuBLAS), whose sums are
ordered otherwise, so bf16 output can still depend on a step's rows (kernels.row_invariant keeps small steps off
this kernel: kernels/gemv.py's row grid runs each row as one). Same roundings as the GEMV (kernels/gemv.py) up to the order
of the sum: float32 sums, the bias added in float32, gated: the linear outputs and silu(gate) rounded to the dtype.
kernels.skinny_rows says how many rows it takes (dispatch.linear; 16 by default, 0: none), kernels.skinny_one_row
names weight shapes whose one-row products it takes from the GEMV (kernels/gemv.py).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl, settings
from llaunch.kernels.pdl_wait import wait_for_previous_kernel
from llaunch.kernels.split_k import added_shares, counters, k_share

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 16  # an MMA's smallest M
# Programs a launch aims for when it splits K: two per SM of an H200 (132); a split also keeps ≥ 4 K tiles a share
TARGET_PROGRAMS = 264
# A layer whose 64-row tiles and splits make fewer programs than this (SmolLM2's 576-wide layers: 9-48) takes
# 16-row tiles: each program's chain of dependent loads is what such a step waits for, not the bandwidth
SMALL_PROGRAMS = 64
INTERPRETED_SHAPE = (16, 64, 4, 1, 1)  # few, small programs: the interpreter runs each as a Python loop


def launch_shape(n: int, k: int, gated: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, WARPS, STAGES, SPLIT) for a layer shape: kernels.skinny_shapes where it names it, else
    64 rows (32 gated: two tiles a step) × 128 columns, 4 stages, K split while the programs stay within
    TARGET_PROGRAMS; 16 rows where that makes fewer than SMALL_PROGRAMS programs. Fixed per shape, not
    autotuned: the blocks set the order of the sum."""
    override = settings.current.skinny_shapes.get((n, k, gated))
    if override is not None:
        return override
    if _INTERPRETED:
        return (*INTERPRETED_SHAPE[:4], 1) if gated else INTERPRETED_SHAPE
    block_n = 32 if gated else 64
    split = _split(triton.cdiv(n, block_n), k, gated)
    if triton.cdiv(n, block_n) * split < SMALL_PROGRAMS:
        block_n = 16
        split = _split(triton.cdiv(n, block_n), k, gated)
    return block_n, 128, 4, 4, split


def _split(tiles: int, k: int, gated: bool) -> int:
    """K's split for `tiles` output tiles of 128-column steps: doubled while the programs stay within
    TARGET_PROGRAMS and each share keeps ≥ 4 steps (never for gate‖up)."""
    split = 1
    while not gated and split < 8 and tiles * split * 2 <= TARGET_PROGRAMS and triton.cdiv(k, 128) >= 4 * split * 2:
        split *= 2
    return split


@triton.jit
def _tile_dot(x, w, INTERPRETED: tl.constexpr):
    """[16, BLOCK_K] · [BLOCK_N, BLOCK_K]ᵀ in float32 (the interpreter's dot in float32: bf16 there is not exact)."""
    if INTERPRETED:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
    return tl.dot(x, tl.trans(w), out_dtype=tl.float32)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, x_stride, w_stride, out_stride,
                   up_offset, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr, INTERPRETED: tl.constexpr):
    tile = tl.program_id(0)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (weight rows)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64) * w_stride
    m = tl.arange(0, 16)
    m_mask = m < M
    x_rows = x_ptr + m.to(tl.int64) * x_stride
    cols = tl.arange(0, BLOCK_K)
    wait_for_previous_kernel(PDL)  # x is the previous kernel's
    k_begin, k_end = k_share(K, BLOCK_K, SPLIT)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    up_acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        k_mask = k0 + cols < k_end
        x = tl.load(x_rows[:, None] + k0 + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        mask = row_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows[:, None] + k0 + cols[None, :], mask=mask, other=0.0)
        acc += _tile_dot(x, w, INTERPRETED)
        if GATED:
            up = tl.load(w_rows[:, None] + up_offset + k0 + cols[None, :], mask=mask, other=0.0)
            up_acc += _tile_dot(x, up, INTERPRETED)
    out_mask = m_mask[:, None] & row_mask[None, :]
    last = True
    if SPLIT > 1:  # (never GATED: skinny_gemm refuses it) the partial sums, then the tile's last program adds them
        parts = part_ptr + m[:, None] * N + rows[None, :]  # [SPLIT, 16, N] float32
        acc, last = added_shares(acc, parts, 16 * N, out_mask, count_ptr, tile, SPLIT)
    if last:
        y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        dtype = out_ptr.dtype.element_ty
        if GATED:  # round as the unfused path does: linear outputs to the dtype, silu(gate) to the dtype
            gate = y.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            y = act * up_acc.to(dtype).to(tl.float32)
        tl.store(out_ptr + m[:, None].to(tl.int64) * out_stride + rows[None, :], y.to(dtype), mask=out_mask)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does this product run here: 2..kernels.skinny_rows rows of a 16-bit x and weight, 16-byte aligned rows?"""
    rows = settings.current.settings.skinny_rows
    return (x.dim() == 2 and 2 <= x.shape[0] <= rows and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == x.shape[1]
            and (not x.is_cuda or _mma_16bit(x.device.index or 0)))


@functools.cache
def _mma_16bit(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8  # bf16 MMAs: Ampere on


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                gated: bool = False) -> torch.Tensor:
    """x [M ≤ 16, K] @ weight [N, K]ᵀ (+ bias [N]) → [M, N] in x's dtype; gated: weight is gate‖up [2I, K] and the
    result silu(x gateᵀ) · (x upᵀ), [M, I]."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1 to {MAX_ROWS} rows, got x of shape {tuple(x.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"skinny_gemm: x is {x.dtype}, weight {weight.dtype}, bias {None if bias is None else bias.dtype}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_gemm: x has {x.shape[1]} columns, weight {weight.shape[1]}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"skinny_gemm: a gated weight stacks gate and up, so it needs an even row count, got {weight.shape[0]}")
    if gated and bias is not None:
        raise ValueError("skinny_gemm: a gated layer without bias (its epilogue adds none to the up half)")
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    bias = bias.contiguous() if bias is not None else None
    n_total, k = weight.shape
    n = n_total // 2 if gated else n_total
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_n, block_k, warps, stages, split = launch_shape(n, k, gated)
    if split > 1 and gated:
        raise ValueError("skinny_gemm: a split of K is for ungated layers (gate‖up has programs enough)")
    tiles = triton.cdiv(n, block_n)
    parts = torch.empty((split, 16, n), dtype=torch.float32, device=x.device) if split > 1 else out
    counts = counters(x.device, tiles) if split > 1 else out
    use_pdl = pdl.enabled(x, "gemv")
    _skinny_kernel[(tiles, split)](
        x, weight, bias if bias is not None else x, out, parts, counts, x.shape[0], n, k, x.stride(0),
        weight.stride(0), out.stride(0), n * weight.stride(0), HAS_BIAS=bias is not None, GATED=gated,
        PDL=pdl.flavor(use_pdl, "gemv"), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT=split,
        INTERPRETED=_INTERPRETED, num_warps=warps, launch_pdl=use_pdl)
    return out
