"""RMSNorm over the last dim, with the residual add fused: one read of x (and residual), one write
of the normalized output (and of h = x + residual). Same rounding points as reference.rmsnorm.

For an fp8 layer after it (W8A8, one activation scale a token) the normalized row can leave as that layer's input:
e4m3 values and the row's scale, the bytes kernels/fp8_rows.quantize_rows makes of the 16-bit output (the row is
in registers already: its absmax costs no read), one kernel where there were two."""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl
from llaunch.kernels.e4m3 import e4m3_of, scale_of_absmax
from llaunch.kernels.pdl_wait import wait_for_previous_kernel

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, s_ptr, xs_ptr, n_cols, x_stride, res_stride, eps,
                    scale_ub, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr,
                    QUANT: tl.constexpr, STATIC: tl.constexpr, HAS_UB: tl.constexpr, INTERPRETED: tl.constexpr):
    wait_for_previous_kernel(PDL)  # nothing before this reads or writes what an earlier kernel touches
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)  # the reference rounds to x's dtype before * weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(w_ptr.dtype.element_ty if QUANT else out_ptr.dtype.element_ty)
    if QUANT:  # the 16-bit output as quantize_rows reads it: its absmax (masked columns are 0), scale, e4m3 values
        yf = y.to(tl.float32)
        if STATIC:
            scale = tl.load(xs_ptr)
        else:
            amax = tl.max(tl.abs(yf), axis=0)
            if HAS_UB:
                amax = tl.minimum(amax, scale_ub)
            scale = scale_of_absmax(amax)
        tl.store(s_ptr + row, scale)
        tl.store(out_ptr + row * n_cols + cols, e4m3_of(yf, scale, not STATIC and not HAS_UB, INTERPRETED), mask=mask)
    else:
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A 2-D [rows, n] view with unit column stride (copies only if the last dim is strided)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """RMSNorm over the last dim. With `residual`: h = x + residual; returns (norm(h), h)."""
    return _launch(x, weight, eps, residual)


def rmsnorm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                      scale_ub: Optional[float] = None, static_scale: Optional[torch.Tensor] = None):
    """RMSNorm over the last dim whose output is quantized per row for an fp8 layer: ((e4m3 [M, n], float32 scales
    [M, 1]), h) with `residual`, else (e4m3, scales) — what quantize_rows(rmsnorm(...)) gives (the model's 16-bit
    output, then each row by its absmax / 448 clipped to scale_ub, or by `static_scale`), in one kernel."""
    return _launch(x, weight, eps, residual, quant=(scale_ub, static_scale))


def _launch(x, weight, eps, residual, quant=None):
    n = x.shape[-1]
    x2 = _rows(x, n)
    h_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out_dtype = torch.promote_types(h_dtype, weight.dtype)
    rows = x2.shape[0]
    if quant is not None:
        if out_dtype != weight.dtype:
            raise ValueError(f"rmsnorm_quantized rounds the output to the weight's {weight.dtype}, not {out_dtype}")
        out = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    else:
        out, scales = torch.empty(x.shape, dtype=out_dtype, device=x.device), None
    h = torch.empty(x.shape, dtype=h_dtype, device=x.device) if residual is not None else out
    r2 = _rows(residual, n) if residual is not None else x2
    result = out if quant is None else (out, scales)
    if rows == 0:
        return (result, h) if residual is not None else result
    block = triton.next_power_of_2(n)
    # With a residual, the normalized input is h (rounded to h's dtype), so the kernel reads it as h.
    src = x2 if residual is None or x.dtype == h_dtype else x2.to(h_dtype)
    scale_ub, static = quant if quant is not None else (None, None)
    use_pdl = pdl.enabled(x, "rmsnorm")
    _rmsnorm_kernel[(rows,)](
        src, r2, weight, out, h, out if scales is None else scales,
        static.float() if static is not None else weight, n, src.stride(0), r2.stride(0), eps, scale_ub or 0.0,
        HAS_RESIDUAL=residual is not None, PDL=pdl.flavor(use_pdl, "rmsnorm"), BLOCK=block,
        QUANT=quant is not None, STATIC=static is not None, HAS_UB=scale_ub is not None and static is None,
        INTERPRETED=_INTERPRETED, num_warps=min(16, max(1, block // 512)), launch_pdl=use_pdl)
    return (result, h) if residual is not None else result
