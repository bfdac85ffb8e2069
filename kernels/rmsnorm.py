"""RMSNorm over the last dim, with the residual add fused: one read of x (and residual), one write
of the normalized output (and of h = x + residual). Same rounding points as reference.rmsnorm."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl
from llaunch.kernels.pdl_wait import wait_for_previous_kernel


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, n_cols, x_stride, res_stride, eps,
                    HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(out_ptr + row * n_cols + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A 2-D [rows, n] view with unit column stride (copies only if the last dim is strided)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """RMSNorm over the last dim. With `residual`: h = x + residual; returns (norm(h), h)."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    h_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    out = torch.empty(x.shape, dtype=torch.promote_types(h_dtype, weight.dtype), device=x.device)
    h = torch.empty(x.shape, dtype=h_dtype, device=x.device) if residual is not None else out
    r2 = _rows(residual, n) if residual is not None else x2
    if x2.shape[0] == 0:
        return (out, h) if residual is not None else out
    block = triton.next_power_of_2(n)
    # With a residual, the normalized input is h (rounded to h's dtype), so the kernel reads it as h.
    src = x2 if residual is None or x.dtype == h_dtype else x2.to(h_dtype)
    use_pdl = pdl.enabled(x, "rmsnorm")
    _rmsnorm_kernel[(x2.shape[0],)](
        src, r2, weight, out, h, n, src.stride(0), r2.stride(0), eps,
        HAS_RESIDUAL=residual is not None, PDL=pdl.flavor(use_pdl, "rmsnorm"), BLOCK=block,
        num_warps=min(16, max(1, block // 512)), launch_pdl=use_pdl)
    return (out, h) if residual is not None else out
