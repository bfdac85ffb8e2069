"""Block-wise fp8 linear layers (the fp8 releases of DeepSeek-V3 and Qwen3: `weight_block_size`
[128, 128]): e4m3 weights with one float32 scale per block of rows × BLOCK_K columns, activations
quantized at run time per token per BLOCK_K-column group (1 × 128, dynamic), and a GEMM that
accumulates each K-block's fp8 dot in float32 times a_scale[m, kb] · b_scale[n // GROUP_N, kb]
(vLLM's and SGLang's w8a8_block_fp8_matmul).

GROUP_N is the rows one scale row covers on this rank: the checkpoint's block rows, or 1 where a
fused or tensor-parallel layer's rows do not start on block boundaries (runtime/models/fp8_linear.py
then gives every row its block's scale). The same roundings in plain torch: kernels/fp8.py.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels.e4m3 import FP8_MAX_C, round_to_e4m3, scale_of_absmax
from llaunch.kernels.fp8 import Fp8Weight

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GROUPS_PER_PROGRAM = 8  # activation groups one quantizing program handles (1,024 values at 128)


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, n_groups, stride_xm, stride_qm, stride_sm,
                            GROUP: tl.constexpr, GROUPS: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g[:, None] < n_groups) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = scale_of_absmax(tl.max(tl.abs(x), axis=1))
    y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX_C, FP8_MAX_C)
    if INTERPRETED:
        y = round_to_e4m3(y)
    tl.store(q_ptr + row * stride_qm + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, scale, mask=g < n_groups)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], float32 scales [M, ceil(K / group)]): each token's `group`-column
    slices scaled by their own absmax / 448 (kernels/fp8.group_scales in torch)."""
    m, k = x.shape
    n_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m:
        grid = (m, triton.cdiv(n_groups, GROUPS_PER_PROGRAM))
        _quantize_groups_kernel[grid](x, q, scales, k, n_groups, x.stride(0), q.stride(0), scales.stride(0),
                                      GROUP=group, GROUPS=GROUPS_PER_PROGRAM, INTERPRETED=_INTERPRETED)
    return q, scales


@triton.jit
def _block_matmul_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                         stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                         GROUP_N: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIZZLE_M: tl.constexpr):
    # programs sharing a column of weight tiles run close together, so those tiles stay in L2
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_band = SWIZZLE_M * num_n
    first_m = (pid // per_band) * SWIZZLE_M
    band_rows = tl.minimum(num_m - first_m, SWIZZLE_M)
    pid_m = first_m + (pid % per_band) % band_rows
    pid_n = (pid % per_band) // band_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_in, n_in = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N], K-major
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_in = offs_k < K - kb * BLOCK_K  # the last block of a K that 128 does not divide
        a = tl.load(a_ptrs, mask=m_in[:, None] & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=m_in, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_in, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_in[:, None] & n_in[None, :])


def _launch_shape(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for m rows: narrow tiles spread a decode step's few rows
    over more programs; prefill takes 128 × 128 tiles (two operands of 16 KiB a stage)."""
    if _INTERPRETED:
        return 16, 32, 4, 1
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def block_matmul(q: torch.Tensor, a_scales: torch.Tensor, weight: torch.Tensor, w_scales: torch.Tensor,
                 group_n: int, block_k: int, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """q [M, K] e4m3 with a_scales [M, ceil(K / block_k)] times weight [N, K] e4m3 with w_scales
    [ceil(N / group_n), ceil(K / block_k)] → [M, N] in out_dtype (bias added in float32 first)."""
    m, k = q.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    block_m, block_n, warps, stages = _launch_shape(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_matmul_kernel[grid](q, weight, out, a_scales, w_scales, bias if bias is not None else out, m, n, k,
                               q.stride(0), weight.stride(0), out.stride(0), a_scales.stride(0), w_scales.stride(0),
                               GROUP_N=group_n, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k, SWIZZLE_M=8, num_warps=warps, num_stages=stages)
    return out


def fp8_block_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] through a block-wise fp8 layer (w.block = (rows per scale row, columns per block)),
    activations quantized per token per block of columns: two kernels."""
    group_n, block_k = w.block
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    q, a_scales = quantize_groups(flat, block_k)
    y = block_matmul(q, a_scales, w.weight, w.scale, group_n, block_k, bias, x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])
