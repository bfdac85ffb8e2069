"""fp8 (e4m3) linear layers: weights stored as float8_e4m3fn with float32 scales, one per output
channel (or per tensor, expanded to channels) or one per block of rows × columns (block-wise
checkpoints); activations quantized at run time per token, or per token per block of columns for
block-wise weights (or with a checkpoint's static per-tensor scale, or not at all: weight-only).

GPU: per-channel layers through torch._scaled_mm (cuBLASLt fp8 GEMM) with row-wise scales,
activations [M, K] row-major and weights [N, K] row-major given as their column-major transpose; a one-row
step (batch-1 decode) through the GEMV (kernels/gemv.py), which quantizes the row as it reads it and
applies the row's and each channel's scale to the float32 sums;
block-wise layers through the Triton kernels of kernels/fp8_block.py. CPU: the reference, which
performs the same roundings (activations to e4m3 and back, weights times scales) in the model's
dtype, so CPU tests check the GPU path's numerics (up to the GEMM's accumulation order).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row keeps a finite scale (vLLM's floor)
DYNAMIC, STATIC, NONE = "dynamic", "static", "none"  # activation modes (runtime/models/quant_scheme.py)


class Fp8Weight(NamedTuple):
    """What an fp8 linear layer hands the `linear` op in place of a weight tensor."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    # float32, per channel [N]: row n of the real weight is weight[n] * scale[n]; block-wise
    # [ceil(N / block[0]), ceil(K / block[1])]: weight[n, k] * scale[n // block[0], k // block[1]]
    scale: torch.Tensor
    activations: str = DYNAMIC  # dynamic (per token; per token per block[1] columns if block-wise) | static | none
    input_scale: Optional[torch.Tensor] = None  # static: [] float32
    scale_ub: Optional[float] = None  # dynamic: a token's absmax is clipped to this (FBGEMM's activation_scale_ub)
    block: Optional[tuple[int, int]] = None  # block-wise: (rows, columns) one scale covers; None: per channel


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturating at ±448 (a plain cast would make NaN of larger values)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def token_scales(x: torch.Tensor, scale_ub: Optional[float] = None) -> torch.Tensor:
    """One float32 scale per row of x [M, K]: its absmax / 448 → [M, 1]."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    # a tensor divisor, as in group_scales: the true quotient the kernels take (kernels/e4m3.scale_of_absmax)
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def group_scales(x: torch.Tensor, group: int) -> torch.Tensor:
    """One float32 scale per `group` columns of each row of x [M, K] (the last group may be
    narrower): their absmax / 448 → [M, ceil(K / group)]."""
    m, k = x.shape
    padded = F.pad(x.abs().float(), (0, -k % group))  # zeros never raise an absmax
    amax = padded.view(m, -1, group).amax(dim=-1)
    # divided by a tensor: CUDA divides a tensor by a Python number as a product with its reciprocal, one
    # ulp off the true quotient the Triton kernel takes (kernels/fp8_block.py) in ~1% of the scales
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def expand_columns(scales: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Scales per group of columns [R, ceil(k / group)] → per column [R, k]."""
    return scales.repeat_interleave(group, dim=1)[:, :k]


def quantize_activations(x: torch.Tensor, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], float32 scales) as `w`'s activation mode says: [M, 1] per token (or
    static), [M, K] per column (block-wise: each token's block of columns has its own)."""
    if w.block is not None:
        scale = expand_columns(group_scales(x, w.block[1]), w.block[1], x.shape[1])
    elif w.activations == STATIC:
        scale = w.input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    else:
        scale = token_scales(x, w.scale_ub)
    return to_fp8(x, scale), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] → (e4m3 [N, K], float32 scale per output channel [N])."""
    scale = (weight.abs().amax(dim=1).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(weight, scale[:, None]), scale


def quantize_weight_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] → (e4m3 [N, K], float32 scale per block [ceil(N / rows), ceil(K / columns)]),
    as block-wise checkpoints are written."""
    n, k = weight.shape
    rows, cols = block
    padded = F.pad(weight.abs().float(), (0, -k % cols, 0, -n % rows))
    amax = padded.view(padded.shape[0] // rows, rows, -1, cols).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(weight, expand_columns(scale.repeat_interleave(rows, dim=0)[:n], cols, k)), scale


def dequantize_weight(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    if w.block is None:
        return (w.weight.float() * w.scale[:, None]).to(dtype)
    n, k = w.weight.shape
    rows = torch.arange(n, device=w.scale.device) // w.block[0]
    cols = torch.arange(k, device=w.scale.device) // w.block[1]
    return (w.weight.float() * w.scale[rows[:, None], cols[None, :]]).to(dtype)


def reference_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The roundings of the GPU path in plain torch: activations to e4m3 and back, dequantized weights
    (block-wise: the same sum as kernels/fp8_block.py's per-block float32 accumulation)."""
    if w.activations != NONE:
        flat = x.reshape(-1, x.shape[-1])
        q, scale = quantize_activations(flat, w)
        x = (q.float() * scale).to(x.dtype).reshape(x.shape)
    return F.linear(x, dequantize_weight(w, x.dtype), bias)


@functools.lru_cache(maxsize=None)
def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1 on the device, made once: a fill kernel per fp8 layer otherwise."""
    return torch.ones((), dtype=torch.float32, device=device)


def scaled_mm_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None,
                     quantize: Callable = quantize_activations, epilogue: Optional[Callable] = None) -> torch.Tensor:
    """cuBLASLt's fp8 GEMM with a scale per token (scale_a [M, 1]) and per channel (scale_b [1, N]).
    Weight-only checkpoints (activations none, also block-wise ones) dequantize the weight and run
    the model dtype's GEMM. `quantize(x [M, K], w)`: the activations' e4m3 values and [M, 1] scales
    (on a GPU the one-kernel kernels/fp8_rows.py, by way of dispatch.fp8_linear). `epilogue(y, row scales,
    channel scales, bias, dtype)`: the per-tensor GEMM with unit scales instead, its bfloat16 sums scaled (and the
    bias added) by it (kernels/fp8_epilogue.py, kernels.fp8_gemm=tensor_epilogue)."""
    if w.activations == NONE:
        return F.linear(x, dequantize_weight(w, x.dtype), bias)
    q, scale = quantize(x.reshape(-1, x.shape[-1]), w)
    return scaled_mm_rows(q, scale, w, bias, x.dtype, tuple(x.shape[:-1]), epilogue)


def scaled_mm_sums(q: torch.Tensor, scale: torch.Tensor, w: Fp8Weight, rowwise: bool) -> torch.Tensor:
    """cuBLASLt's fp8 GEMM of q [M, K] (scale [M, 1]) and w in bfloat16: with the token and channel scales in it
    (rowwise), else the per-tensor GEMM with unit scales (the unscaled sums, for an epilogue to scale)."""
    if not rowwise:
        one = _unit_scale(q.device)
        return torch._scaled_mm(q, w.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    # row-wise scaling wants bfloat16 out; b is the weight's transpose, a column-major [K, N] view
    return torch._scaled_mm(q, w.weight.t(), scale_a=scale.contiguous(), scale_b=w.scale.view(1, -1),
                            out_dtype=torch.bfloat16)


def scaled_mm_rows(q: torch.Tensor, scale: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor],
                   dtype: torch.dtype, lead: tuple, epilogue: Optional[Callable] = None) -> torch.Tensor:
    """scaled_mm_linear's GEMM of activations already in e4m3 (q [M, K], scale [M, 1]) → [*lead, N] in dtype."""
    y = scaled_mm_sums(q, scale, w, rowwise=epilogue is None)
    if epilogue is not None:
        return epilogue(y, scale, w.scale, bias, dtype).reshape(*lead, y.shape[-1])
    y = y.to(dtype).reshape(*lead, y.shape[-1])
    return y if bias is None else y + bias
