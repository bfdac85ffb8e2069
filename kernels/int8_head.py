"""The LM head with int8 weights (model.int8_lm_head): each vocabulary row rounded to int8 with a float32 scale of its
own (symmetric, round to nearest: row absmax / 127), the inputs left in the model's dtype (weight-only). Half the bytes
of a 16-bit head, which a batch-1 decode step reads whole every token (Qwen2-7B's: 1.09 GB of bf16 against ~6.5 GB of
fp8 body weights). Why int8 and not e4m3 (model.fp8_lm_head): over SmolLM2's 2,048 positions of this repository's docs
(`scripts/fp8_accuracy.py`) the fp8 body with an int8 head agrees with float32 on 87.9% of the top-1 tokens against
its 88.5% with the 16-bit head; with the head in e4m3 80.7%, and int8 inputs as well (W8A8) 84.7%. An int8 value is
exact in bfloat16 and float16 (8 significant bits), so the products are exact in float32 and the sums differ from
the reference's (kernels/int8.py, which also quantizes) only in their order.

One kernel, two paths by the step's rows: one row (batch-1 decode; each row alike under kernels.row_invariant) on the
CUDA cores, each program a tile of vocabulary rows read once, every weight to float32 for its FMA; more rows on the tensor cores, x's rows in tiles of
BLOCK_M (16 up to 16 rows) against each weight tile converted to x's dtype (tl.dot, float32 sums). The row scale and
the rounding to x's dtype in the epilogue; the logits come back float32 (as lm_head_linear's other paths: the
x-dtype value widened). The launch shapes are the module's constants below, not yet measured on a GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl, settings
from llaunch.kernels.int8 import Int8Rows
from llaunch.kernels.pdl_wait import wait_for_previous_kernel

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES): one row on the CUDA cores (BLOCK_M 1); up to 16 rows, and more
ONE_ROW_SHAPE = (1, 4, 1024, 4, 0)
FEW_ROWS_SHAPE = (16, 64, 128, 4, 4)
MANY_ROWS_SHAPE = (64, 128, 64, 8, 3)
INTERPRETED_SHAPES = ((1, 4, 64, 4, 0), (16, 16, 32, 4, 1), (32, 16, 32, 4, 1))


@triton.jit
def _head_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                 IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # vocabulary rows (the logits' columns)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64) * w_stride
    cols = tl.arange(0, BLOCK_K)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    x_rows = x_ptr + m.to(tl.int64) * x_stride
    if BLOCK_M == 1:  # a row (program_id(1)) alone: the weights to float32, multiplied by it, summed per vocabulary row
        x_ptr += tl.program_id(1).to(tl.int64) * x_stride
        mask = row_mask[:, None] & (cols < K)[None, :]
        w = tl.load(w_rows[:, None] + cols[None, :], mask=mask, other=0, eviction_policy="evict_first")
        wait_for_previous_kernel(PDL)  # the weights are constants: the first tile is requested before x is ready
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            nxt = k0 + BLOCK_K + cols
            mask = row_mask[:, None] & (nxt < K)[None, :]  # all false after the last tile: no traffic
            w_next = tl.load(w_rows[:, None] + nxt[None, :], mask=mask, other=0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
            w = w_next
        y = (tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=row_mask, other=0.0))[None, :]
    else:  # x's rows in tiles of BLOCK_M against each weight tile in x's dtype on the tensor cores
        wait_for_previous_kernel(PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k_mask = k0 + cols < K
            x = tl.load(x_rows[:, None] + k0 + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows[:, None] + k0 + cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0)
            if INTERPRETED:  # the interpreter's dot in float32 (bf16 there is not exact)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            elif IEEE:  # a float32 model: float32 products, not TF32's
                acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32)
        y = acc * tl.load(s_ptr + rows, mask=row_mask, other=0.0)[None, :]
    # the logits in float32 holding x's dtype's rounding, as the 16-bit head's
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + m[:, None].to(tl.int64) * out_stride + rows[None, :], y,
             mask=m_mask[:, None] & row_mask[None, :])


def launch_shape(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES) for a step of m rows: one row, and under kernels.row_invariant
    each row of a step of up to 16 (settings.invariant_step), on the one-row code (a row's logits then do not depend
    on the step's other rows: a verify row gets a decode row's bits); else the tensor cores."""
    one, few, many = INTERPRETED_SHAPES if _INTERPRETED else (ONE_ROW_SHAPE, FEW_ROWS_SHAPE, MANY_ROWS_SHAPE)
    return one if m == 1 or settings.invariant_step(m) else few if m <= 16 else many


def logits(x: torch.Tensor, w: Int8Rows) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32) against the int8 head → float32 logits [M, N]."""
    if x.dim() != 2 or x.shape[1] != w.weight.shape[1]:
        raise ValueError(f"int8 head: x [M, {w.weight.shape[1]}], got {tuple(x.shape)}")
    if w.weight.dtype != torch.int8 or w.scale.shape != (w.weight.shape[0],) or w.scale.dtype != torch.float32:
        raise ValueError(f"int8 head: int8 rows and a float32 scale a row, got {w.weight.dtype} "
                         f"{tuple(w.weight.shape)} and {w.scale.dtype} {tuple(w.scale.shape)}")
    x = x.contiguous()
    weight = w.weight if w.weight.stride(-1) == 1 else w.weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps, stages = launch_shape(m)
    use_pdl = pdl.enabled(x, "gemv")
    _head_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, weight, w.scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        PDL=pdl.flavor(use_pdl, "gemv"), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        IEEE=x.dtype == torch.float32, INTERPRETED=_INTERPRETED, num_warps=warps, launch_pdl=use_pdl)
    return out
