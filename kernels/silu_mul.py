"""SiLU-and-multiply of the MLP's fused gate‖up projection: [.., 2I] → silu(gate) * up, [.., I]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inner, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inner + cols, mask=mask, other=0.0)
    # The reference rounds silu(gate) to the input dtype before the multiply.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * inner + cols, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[.., 2I] (gate ‖ up) → silu(gate) * up, [.., I]."""
    inner = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inner)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or inner == 0:
        return out
    block = min(1024, triton.next_power_of_2(inner))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inner, block))](x2, out, inner, x2.stride(0), BLOCK=block,
                                                               num_warps=4)
    return out
