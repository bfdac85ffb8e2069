"""An fp8 layer's activations quantized per token in one kernel, for cuBLASLt's row-wise scaled GEMM.

In torch the dynamic scale and the cast are ~9 kernels a layer (abs, amax, float, /448, clamp, then
float, /scale, clamp, to e4m3), each a few µs of device time and, outside a CUDA graph, a launch: at
Qwen2-7B's 4 fp8 linears × 28 layers that is ~1,000 small kernels a step. Here one program per row
walks the row twice (its absmax, then the e4m3 values; the second pass reads L2) and writes both.
Same roundings as kernels/fp8.quantize_activations: the scale is absmax / 448 (true quotient), floored,
the absmax first clipped to scale_ub; a static scale is used as given.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels.e4m3 import e4m3_of, scale_of_absmax

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_K = 1024


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, xs_ptr, K, stride_xm, stride_qm, scale_ub,
                          STATIC: tl.constexpr, HAS_UB: tl.constexpr, BLOCK_K: tl.constexpr,
                          INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(xs_ptr)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        amax = tl.max(amax, axis=0)
        if HAS_UB:
            amax = tl.minimum(amax, scale_ub)
        scale = scale_of_absmax(amax)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_qm + k0 + cols, e4m3_of(x, scale, not STATIC and not HAS_UB, INTERPRETED),
                 mask=mask)


def quantize_rows(x: torch.Tensor, scale_ub: Optional[float] = None,
                  static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) → (e4m3 [M, K], float32 scales [M, 1]): each row by its absmax / 448
    (clipped to scale_ub), or every row by `static_scale` (a one-element float32 tensor)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_rows takes [M, K] with contiguous rows, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        static = static_scale is not None
        _quantize_rows_kernel[(m,)](x, q, scales, static_scale.float() if static else scales, k, x.stride(0),
                                    q.stride(0), scale_ub or 0.0, STATIC=static,
                                    HAS_UB=scale_ub is not None and not static, BLOCK_K=BLOCK_K,
                                    INTERPRETED=_INTERPRETED, num_warps=4)
    return q, scales
