"""RMSNorm over the last dim, with the residual add fused: one read of x (and residual), one write
of the normalized output (and of h = x + residual). Same rounding points as reference.rmsnorm.

For an fp8 layer after it (W8A8, one activation scale a token) the normalized row can leave as that layer's input:
e4m3 values and the row's scale, the bytes kernels/fp8_rows.quantize_rows makes of the 16-bit output (the row is
in registers already: its absmax costs no read), one kernel where there were two.

And after an fp8 layer whose GEMM leaves its scales to an epilogue (kernels.fp8_gemm=tensor_epilogue: o_proj,
down_proj), x can come as that GEMM's unscaled bfloat16 sums with their token and channel scales: the norm scales
them as kernels/fp8_epilogue.py would (the same roundings) before the residual add, and the epilogue's kernel, its
write and this kernel's read of a 16-bit [M, hidden] go (kernels.fp8_norm_epilogue)."""
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
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, s_ptr, xs_ptr, rs_ptr, cs_ptr, n_cols, x_stride,
                    res_stride, eps, scale_ub, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr,
                    QUANT: tl.constexpr, STATIC: tl.constexpr, HAS_UB: tl.constexpr, SUMS: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    wait_for_previous_kernel(PDL)  # nothing before this reads or writes what an earlier kernel touches
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    x_dtype = x_ptr.dtype.element_ty
    if SUMS:  # an fp8 GEMM's unscaled sums: · the token's scale · the channel's, in h's dtype (fp8_epilogue's order)
        x_dtype = h_ptr.dtype.element_ty
        x = (x.to(tl.float32) * tl.load(rs_ptr + row) * tl.load(cs_ptr + cols, mask=mask, other=0.0)).to(x_dtype)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x_dtype)  # the reference rounds to x's dtype before * weight
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


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
            sums_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
    """RMSNorm over the last dim. With `residual`: h = x + residual; returns (norm(h), h). `sums_scales`: x is an
    fp8 GEMM's unscaled sums and these its (token [M, 1], channel [n]) float32 scales; x · scales is rounded to the
    residual's dtype (as kernels/fp8_epilogue.py's output in it) before the add, which it needs."""
    return _launch(x, weight, eps, residual, sums=sums_scales)


def rmsnorm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                      scale_ub: Optional[float] = None, static_scale: Optional[torch.Tensor] = None,
                      sums_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
    """RMSNorm over the last dim whose output is quantized per row for an fp8 layer: ((e4m3 [M, n], float32 scales
    [M, 1]), h) with `residual`, else (e4m3, scales) — what quantize_rows(rmsnorm(...)) gives (the model's 16-bit
    output, then each row by its absmax / 448 clipped to scale_ub, or by `static_scale`), in one kernel.
    `sums_scales` as rmsnorm's."""
    return _launch(x, weight, eps, residual, quant=(scale_ub, static_scale), sums=sums_scales)


def _launch(x, weight, eps, residual, quant=None, sums=None):
    n = x.shape[-1]
    x2 = _rows(x, n)
    if sums is not None and residual is None:
        raise ValueError("rmsnorm takes an fp8 GEMM's unscaled sums only with a residual (their dtype is its)")
    h_dtype = residual.dtype if sums is not None else \
        torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
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
    src = x2 if residual is None or x.dtype == h_dtype or sums is not None else x2.to(h_dtype)
    scale_ub, static = quant if quant is not None else (None, None)
    row_scales, channel_scales = (sums[0].reshape(-1).float().contiguous(), sums[1].float().contiguous()) \
        if sums is not None else (weight, weight)
    use_pdl = pdl.enabled(x, "rmsnorm")
    _rmsnorm_kernel[(rows,)](
        src, r2, weight, out, h, out if scales is None else scales,
        static.float() if static is not None else weight, row_scales, channel_scales, n, src.stride(0), r2.stride(0),
        eps, scale_ub or 0.0, HAS_RESIDUAL=residual is not None, PDL=pdl.flavor(use_pdl, "rmsnorm"), BLOCK=block,
        QUANT=quant is not None, STATIC=static is not None, HAS_UB=scale_ub is not None and static is None,
        SUMS=sums is not None, INTERPRETED=_INTERPRETED, num_warps=min(16, max(1, block // 512)), launch_pdl=use_pdl)
    return (result, h) if residual is not None else result
