"""int8 rows with a float32 scale each (model.int8_lm_head's LM head, model.quantization=int8's linears): the rounding
and the plain-torch reference of what kernels/int8_rows.py computes. No Triton here: CPU-only installs load and run
them through these."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

QMAX = 127  # symmetric: -127..127 (the -128 code unused, so a row's absmax maps to ±127 exactly)


class Int8Rows(NamedTuple):
    """A weight as model.int8_lm_head (an LM head) and model.quantization=int8 (a linear) keep it: int8 [N, K] and a
    float32 scale per row [N]."""

    weight: torch.Tensor
    scale: torch.Tensor


def quantize_rows(w: torch.Tensor) -> Int8Rows:
    """w [N, K] → int8 rows, each scaled by its absmax / 127 (an all-zero row: scale 1, zeros)."""
    amax = w.abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = (w.float() / scale[:, None]).round().clamp(-QMAX, QMAX).to(torch.int8)
    return Int8Rows(q, scale)


def dequantized(w: Int8Rows, dtype: torch.dtype) -> torch.Tensor:
    """The head's weight as float32 values of the int8 rows times their scales, in `dtype`."""
    return (w.weight.float() * w.scale[:, None]).to(dtype)


def reference_logits(x: torch.Tensor, w: Int8Rows, rows_at_once: int = 16384) -> torch.Tensor:
    """x [M, K] against the int8 rows → float32 logits [M, N]: each int8 value times x in float32, summed, times the
    row's scale, rounded to x's dtype (the kernel's roundings up to the order of the sum), a block of vocabulary rows at
    a time so a large head's float32 copy is never whole."""
    return _reference(x, w, None, torch.float32, rows_at_once)


def reference_linear(x: torch.Tensor, w: Int8Rows, bias: Optional[torch.Tensor] = None,
                     rows_at_once: int = 16384) -> torch.Tensor:
    """x [..., K] through the int8 rows (+ bias) → [..., N] in x's dtype: reference_logits' sums, the bias added in
    float32 before the one rounding (kernels/int8_rows.linear's)."""
    flat = x.reshape(-1, x.shape[-1])
    return _reference(flat, w, bias, x.dtype, rows_at_once).reshape(*x.shape[:-1], w.weight.shape[0])


def _reference(x, w: Int8Rows, bias, out_dtype, rows_at_once: int) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.weight.shape[0]), dtype=out_dtype, device=x.device)
    xf = x.float()
    for start in range(0, w.weight.shape[0], rows_at_once):
        block = slice(start, start + rows_at_once)
        sums = F.linear(xf, w.weight[block].float()) * w.scale[block]
        if bias is not None:
            sums = sums + bias[block].float()
        out[:, block] = sums.to(x.dtype).to(out_dtype)
    return out
