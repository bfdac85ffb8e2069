"""A linear layer of 2–8 rows (y = x Wᵀ + b) in one pass over the weights: a speculative verify step's
k+1 tokens of one row, or a small decode batch.

The step reads every weight once whatever its rows, so, as for one row (kernels/gemv.py), the speed is the
weight-read bandwidth; cuBLAS's small-M GEMMs stream them slower (a batch-1 verify step of 2–5 tokens took
1.20–1.22× a decode step on an H200, docs/performance.md). Each program owns BLOCK_N output columns and walks
K, every weight tile multiplied into all ROWS rows of x (padded to a power of two, masked) before the next;
float32 sums, one rounding to the output dtype, the bias added before it. No fp8 weights, no gate‖up fusion:
those take dispatch's other paths. Used for rows up to kernels.gemv_rows (1: never).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 8


def launch_shape(rows: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): ROWS × BLOCK_N × BLOCK_K float32 partial sums live in registers, so
    wider row counts take narrower K tiles (untuned: a first guess at the one-row GEMV's 1k-column tiles)."""
    if _INTERPRETED:
        return 32, 256, 4
    block_k = min(1024 // max(1, triton.next_power_of_2(rows) // 2), max(64, triton.next_power_of_2(k)))
    return 4, block_k, 4


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride,
                      HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    ks = tl.arange(0, BLOCK_K)
    n_in, m_in = cols_n < N, rows < M
    w_rows = w_ptr + cols_n.to(tl.int64)[:, None] * w_stride
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = k0 + ks < K
        w = tl.load(w_rows + k0 + ks[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        x = tl.load(x_rows + k0 + ks[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (2 ≤ M ≤ 8, rows contiguous) @ weight [N, K]ᵀ (+ bias [N]) → [M, N] in x's dtype."""
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS or x.stride(-1) != 1:
        raise ValueError(f"gemv_rows takes 1 to {MAX_ROWS} rows with contiguous columns, got {tuple(x.shape)}")
    if weight.dtype != x.dtype or weight.shape[1] != k or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"gemv_rows: x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_n, block_k, warps = launch_shape(m, k)
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    return out
