"""The gated MLP's activation-and-multiply of its fused gate‖up projection: [.., 2I] → act(gate) * up, [.., I].
act is SiLU (Llama, Qwen, Mistral, Phi) or GeGLU's gelu_tanh (Gemma):
gelu_tanh(x) = x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU, GELU_TANH = 0, 1


@triton.jit
def _gated_act_mul_kernel(x_ptr, out_ptr, inner, x_stride, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inner + cols, mask=mask, other=0.0)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # √(2/π) (x + 0.044715 x³)
        e = tl.exp2(-2.8853900817779268 * tl.abs(y))  # tanh from e^(-2|y|): no overflow at any y
        t = (1.0 - e) / (1.0 + e)
        act = 0.5 * gate * (1.0 + tl.where(y < 0, -t, t))
    # The reference rounds the activation to the input dtype before the multiply.
    act = act.to(up.dtype)
    tl.store(out_ptr + row * inner + cols, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def _gated_act_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    inner = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inner)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or inner == 0:
        return out
    block = min(1024, triton.next_power_of_2(inner))
    _gated_act_mul_kernel[(x2.shape[0], triton.cdiv(inner, block))](x2, out, inner, x2.stride(0), ACT=act,
                                                                    BLOCK=block, num_warps=4)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[.., 2I] (gate ‖ up) → silu(gate) * up, [.., I]."""
    return _gated_act_mul(x, SILU)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """[.., 2I] (gate ‖ up) → gelu_tanh(gate) * up, [.., I]."""
    return _gated_act_mul(x, GELU_TANH)
