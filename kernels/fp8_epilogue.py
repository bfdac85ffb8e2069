"""The scales of an fp8 GEMM applied after it (kernels.fp8_gemm=tensor_epilogue): cuBLASLt's per-tensor fp8 GEMM
with unit scales writes the unscaled sums of e4m3 products in bfloat16 (a relative rounding: their magnitude
does not matter), and one kernel here multiplies each by its token's and its channel's scale, adds the bias and
rounds to the model's dtype. The row-wise scaled GEMM (the default) runs 128 x 128 tiles at 64-320 rows on an
H200 (scripts/profile_kernels.py); the per-tensor one took 16-30% less time at 16-256 rows there (the GEMM alone,
scripts/bench_fp8_gemm.py), at the cost of one rounding more.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_N = 1024


@triton.jit
def _epilogue_kernel(y_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr, N, stride_y, stride_out, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """out[m, n] = y[m, n] · as[m] · bs[n] (+ bias[n]), in out's dtype: one program a row and BLOCK_N columns."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    y = tl.load(y_ptr + m * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    y = (y * tl.load(as_ptr + m) * tl.load(bs_ptr + offs, mask=mask, other=0.0)).to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # added to the rounded product, as the row-wise path's `y + bias`
        y = (y.to(tl.float32) + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(y.dtype)
    tl.store(out_ptr + m * stride_out + offs, y, mask=mask)


def scale_rows_and_channels(y: torch.Tensor, row_scales: torch.Tensor, channel_scales: torch.Tensor,
                            bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] (the unscaled sums) · row_scales [M] or [M, 1] · channel_scales [N] (+ bias [N]) → [M, N] dtype."""
    m, n = y.shape
    out = torch.empty((m, n), dtype=dtype, device=y.device)
    if m and n:
        row_scales = row_scales.reshape(-1).float().contiguous()
        _epilogue_kernel[(m, triton.cdiv(n, BLOCK_N))](
            y, row_scales, channel_scales.float().contiguous(), bias if bias is not None else y, out, n, y.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, num_warps=4)
    return out
