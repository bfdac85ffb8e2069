"""One-row q‖k‖v projection with the rotary embedding and the KV-cache store in its epilogue.

Used with LLAUNCH_QKV_ROTARY=1; by default a batch-1 decode step runs the qkv GEMV, then the
rotary + store kernel (with rotary under PDL the two measured 1–12 µs a step faster on an H200,
docs/benchmarks.md). Rotate-half pairs output rows i and i + D/2 of one head, so a program here owns
exactly that pair: it sums both rows over all of K (`row_dots`, the same order as the GEMV), adds
the bias, rounds as a linear layer would, rotates q and k heads with the rounding points of
`rotary.py`, and writes q to its output and k, v to the token's cache slot. Same arithmetic and
rounding points as gemv → rotary_store_kv: bit-identical under the interpreter, and on an H200
since rotary.py's build keeps its roundings (46f7d98; 0 of 3,584 q elements differ).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl
from llaunch.kernels.gemv import launch_shape
from llaunch.kernels.row_dots import row_dots


@triton.jit
def _qkv_rotary_kernel(x_ptr, w_ptr, b_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
                       K, w_stride, table_stride, n_q_heads, n_kv_heads, HAS_BIAS: tl.constexpr,
                       PDL: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr):
    head = tl.program_id(0) // HALF
    i = tl.program_id(0) % HALF
    lane = tl.arange(0, 2)
    rows = head * 2 * HALF + i + lane * HALF  # the rotate-half pair (i, i + D/2) of this head
    y, _ = row_dots(x_ptr, w_ptr + rows.to(tl.int64) * w_stride, rows >= 0, K, 0, False, PDL, 2, BLOCK_K)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    ty = q_out_ptr.dtype.element_ty
    y = y.to(ty).to(tl.float32)  # the linear layer's output, rounded as the unfused path stores it
    x1 = tl.sum(tl.where(lane == 0, y, 0.0), axis=0)
    x2 = tl.sum(tl.where(lane == 1, y, 0.0), axis=0)
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cos_ptr + pos * table_stride + i).to(tl.float32)
    sin = tl.load(sin_ptr + pos * table_stride + i).to(tl.float32)
    # each product rounded to the output dtype first, as rotary.py (and transformers) do
    a, b = (x1 * cos).to(ty).to(tl.float32), (x2 * sin).to(ty).to(tl.float32)
    c, d = (x2 * cos).to(ty).to(tl.float32), (x1 * sin).to(ty).to(tl.float32)
    rotated = tl.where(lane == 0, a - b, c + d).to(ty)
    slot = tl.load(slot_ptr).to(tl.int64)
    cache_row = slot * n_kv_heads * 2 * HALF + i + lane * HALF
    if head < n_q_heads:
        tl.store(q_out_ptr + head * 2 * HALF + i + lane * HALF, rotated)
    elif head < n_q_heads + n_kv_heads:
        tl.store(k_cache_ptr + cache_row + (head - n_q_heads) * 2 * HALF, rotated)
    else:
        tl.store(v_cache_ptr + cache_row + (head - n_q_heads - n_kv_heads) * 2 * HALF, y.to(ty))


def qkv_rotary_store_kv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], n_q_heads: int,
                        n_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [1, K] through the fused weight [(Hq + 2·Hkv)·D, K] (+ bias): returns the rotated q [1, Hq, D];
    the rotated k and the v of the token go to row slots[0] of the caches [num_slots, Hkv, D]."""
    dim = k_cache.shape[-1]
    n, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"qkv_rotary_store_kv takes one row, got x of shape {tuple(x.shape)}")
    if n != (n_q_heads + 2 * n_kv_heads) * dim or dim % 2:
        raise ValueError(f"qkv weight has {n} rows, not ({n_q_heads} + 2·{n_kv_heads}) heads × {dim}")
    if not (x.dtype == weight.dtype == k_cache.dtype == v_cache.dtype) or (bias is not None and bias.dtype != x.dtype):
        raise ValueError("qkv_rotary_store_kv: x, weight, bias and the caches must share a dtype")
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    if x.shape[1] != k or k_cache.shape[1] != n_kv_heads:
        raise ValueError(f"qkv_rotary_store_kv: x has {x.shape[1]} columns for a weight of {k}, the cache "
                         f"{k_cache.shape[1]} KV heads for {n_kv_heads}")
    copied = weight.stride(-1) != 1
    if copied:
        weight = weight.contiguous()
    x = x.contiguous()
    bias = bias.contiguous() if bias is not None else None
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((1, n_q_heads, dim), dtype=x.dtype, device=x.device)
    # a program owns two rows (a rotate-half pair): only BLOCK_K and warps come from the qkv weight's
    # launch shape (the staged kernel has no fused epilogue)
    block_k, warps = launch_shape(n, k, False)[1:3]
    use_pdl = pdl.enabled(x, "gemv") and not copied  # the first weight tile is read before the PDL wait
    _qkv_rotary_kernel[(n // 2,)](
        x, weight, bias if bias is not None else x, q, k_cache, v_cache, positions, slots, cos, sin, k,
        weight.stride(0), cos.stride(0), n_q_heads, n_kv_heads, HAS_BIAS=bias is not None,
        PDL=pdl.flavor(use_pdl, "gemv"), HALF=dim // 2, BLOCK_K=block_k, num_warps=warps, launch_pdl=use_pdl)
    return q
