"""Rotate-half (GPT-NeoX) rotary embedding for q and k in one launch: a program per token reads its
cos/sin row once and rotates every q and k head of that token. `rotary_store_kv` also writes the
rotated k and the v of each token straight into its KV-cache slot (one launch instead of two), and with
q_norm / k_norm first normalizes each head (Qwen3's and Gemma 3's RMSNorm over a head, kernels/rmsnorm.py's
roundings): three launches a layer become one. After an fp8 q‖k‖v whose GEMM leaves its scales to an epilogue
(kernels.fp8_gemm=tensor_epilogue), q, k and v can come as that GEMM's unscaled sums: the kernel applies the token's
and each channel's scale and the bias as kernels/fp8_epilogue.py would (its roundings) as it reads them, and the
epilogue kernel goes (kernels.fp8_norm_epilogue)."""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl
from llaunch.kernels.e4m3 import quantized
from llaunch.kernels.fp8 import FP8
from llaunch.kernels.pdl_wait import wait_for_previous_kernel

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# No FP contraction: LLVM narrows round(x1·cos) − round(x2·sin) to bf16 ops, and contraction would
# then make it fma(x1, cos, −round(x2·sin)), one rounding fewer than transformers' q·cos +
# rotate_half(q)·sin (the sm90 build of Triton 3.6 did: on an H200 ~20% of rotated elements moved by
# one bf16 step). tests/kernels/test_rounding_points.py checks the compiled code.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _scaled_sums(y, rs, cs_ptr, b_ptr, cols, mask, ty_ptr, HAS_BIAS: tl.constexpr):
    """An fp8 GEMM's unscaled sums y at channels `cols` · the token's scale rs · each channel's, rounded to ty_ptr's
    dtype (the model's), + the bias and rounded again: kernels/fp8_epilogue.py's output."""
    ty = ty_ptr.dtype.element_ty
    y = (y.to(tl.float32) * rs * tl.load(cs_ptr + cols, mask=mask, other=0.0)).to(ty)
    if HAS_BIAS:
        y = (y.to(tl.float32) + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(ty)
    return y


@triton.jit
def _rotated_heads(src_ptr, token, src_tok_stride, src_head_stride, n_heads, cos, sin, norm_ptr, eps, rs, cs_ptr,
                   b_ptr, ty_ptr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   NORM: tl.constexpr, SUMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A token's heads rotated: their two halves, each rounded to the model's dtype (the source's, or with SUMS,
    where the source holds an fp8 GEMM's unscaled sums: ty_ptr's, after _scaled_sums; cs_ptr and b_ptr at the
    heads' first channel)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < HALF)
    src = src_ptr + token * src_tok_stride + heads * src_head_stride + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    ty = src_ptr.dtype.element_ty
    if SUMS:
        ty = ty_ptr.dtype.element_ty
        x1 = _scaled_sums(x1, rs, cs_ptr, b_ptr, heads * 2 * HALF + dims, mask, ty_ptr, HAS_BIAS)
        x2 = _scaled_sums(x2, rs, cs_ptr, b_ptr, heads * 2 * HALF + HALF + dims, mask, ty_ptr, HAS_BIAS)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # each product rounded to the model's dtype first: the reference's (and transformers') rounding points
    if NORM:  # RMSNorm over each head: normalized and rounded, times the weight and rounded (kernels/rmsnorm.py)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
        x2 = ((x2 * rstd).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
    a, b = (x1 * cos).to(ty).to(tl.float32), (x2 * sin).to(ty).to(tl.float32)
    c, d = (x2 * cos).to(ty).to(tl.float32), (x1 * sin).to(ty).to(tl.float32)
    return (a - b).to(ty), (c + d).to(ty)


@triton.jit
def _store_heads(dst_ptr, row, n_heads, lo, hi, scale_ptr, FP8: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERPRETED: tl.constexpr):
    """A token's heads (their halves lo, hi) to row `row` of dst [rows, n_heads, 2 * HALF]; FP8: divided by the
    scale at scale_ptr and rounded to e4m3 as kernels/fp8.to_fp8 does (an fp8 KV cache's store)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < HALF)
    dst = dst_ptr + row * n_heads * 2 * HALF + heads * 2 * HALF + dims
    if FP8:
        scale = tl.load(scale_ptr)
        lo = quantized(lo.to(tl.float32), scale, INTERPRETED)
        hi = quantized(hi.to(tl.float32), scale, INTERPRETED)
    tl.store(dst, lo.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, hi.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, k_side_ptr, pos_ptr, slots_ptr, cos_ptr,
                   sin_ptr, qn_ptr, kn_ptr, k_scale_ptr, v_scale_ptr, rs_ptr, cs_ptr, b_ptr, eps, q_tok_stride,
                   q_head_stride, k_tok_stride, k_head_stride, v_tok_stride, v_head_stride, n_q_heads, n_k_heads,
                   table_stride, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                   BLOCK_HK: tl.constexpr, STORE: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
                   SIDE: tl.constexpr, SUMS: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    """STORE: k (rotated) and v go to the caches' row slots[token]; else k to k_out's row token. NORM: each q
    head by qn's weights, each k head by kn's, RMSNorm'd first. FP8 (with STORE): the caches are e4m3, k and v
    quantized at the scales k_scale_ptr and v_scale_ptr hold; SIDE: the rotated k also to k_side's row token,
    unrounded (prefill attention reads a chunk's own K/V so). SUMS: q, k and v hold an fp8 q‖k‖v GEMM's unscaled
    sums, scaled by the token's scale at rs_ptr and the channels' at cs_ptr (q's, then k's, then v's), + the bias
    at b_ptr (HAS_BIAS), in q_out's dtype."""
    wait_for_previous_kernel(PDL)  # nothing before this reads or writes what an earlier kernel touches
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + pos * table_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * table_stride + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    rs = 1.0
    if SUMS:
        rs = tl.load(rs_ptr + token)
    k_col, v_col = n_q_heads * 2 * HALF, (n_q_heads + n_k_heads) * 2 * HALF  # their first channels
    lo, hi = _rotated_heads(q_ptr, token, q_tok_stride, q_head_stride, n_q_heads, cos, sin, qn_ptr, eps, rs, cs_ptr,
                            b_ptr, q_out_ptr, HALF, BLOCK_HQ, BLOCK_HALF, NORM, SUMS, HAS_BIAS)
    _store_heads(q_out_ptr, token, n_q_heads, lo, hi, k_scale_ptr, False, HALF, BLOCK_HQ, BLOCK_HALF, INTERPRETED)
    if STORE:
        k_row = tl.load(slots_ptr + token).to(tl.int64)
    else:
        k_row = token
    lo, hi = _rotated_heads(k_ptr, token, k_tok_stride, k_head_stride, n_k_heads, cos, sin, kn_ptr, eps, rs,
                            cs_ptr + k_col, b_ptr + k_col, q_out_ptr, HALF, BLOCK_HK, BLOCK_HALF, NORM, SUMS, HAS_BIAS)
    _store_heads(k_out_ptr, k_row, n_k_heads, lo, hi, k_scale_ptr, FP8, HALF, BLOCK_HK, BLOCK_HALF, INTERPRETED)
    if SIDE:
        _store_heads(k_side_ptr, token, n_k_heads, lo, hi, k_scale_ptr, False, HALF, BLOCK_HK, BLOCK_HALF,
                     INTERPRETED)
    if STORE:
        heads = tl.arange(0, BLOCK_HK)[:, None]
        mask = (heads < n_k_heads) & (dims < HALF)
        src = v_ptr + token * v_tok_stride + heads * v_head_stride + dims
        v_lo, v_hi = tl.load(src, mask=mask), tl.load(src + HALF, mask=mask)
        if SUMS:
            cols = heads * 2 * HALF + dims
            v_lo = _scaled_sums(v_lo, rs, cs_ptr + v_col, b_ptr + v_col, cols, mask, q_out_ptr, HAS_BIAS)
            v_hi = _scaled_sums(v_hi, rs, cs_ptr + v_col, b_ptr + v_col, cols + HALF, mask, q_out_ptr, HAS_BIAS)
        _store_heads(v_out_ptr, k_row, n_k_heads, v_lo, v_hi, v_scale_ptr, FP8, HALF, BLOCK_HK, BLOCK_HALF, INTERPRETED)


def _rotate(q, k, v, positions, cos, sin, k_dst, v_dst, slots, q_norm=None, k_norm=None, eps=0.0, kv_scales=None,
            k_side=None, sums=None) -> torch.Tensor:
    """Launches the kernel; returns the rotated q. With slots, k and v go to the caches' rows slots[t]; with
    q_norm and k_norm ([D] weights), each head RMSNorm'd first; with kv_scales ((k_scale, v_scale): [] float32),
    the caches are e4m3 and k, v are quantized as stored; k_side ([T, Hk, D], k's dtype): the rotated k, too.
    sums ((row scales [T, 1], channel scales [N], bias [N] or None, dtype)): q, k, v are an fp8 q‖k‖v GEMM's
    unscaled sums (the channels q's, then k's, then v's), scaled as read; q comes back in dtype."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos, sin = cos.contiguous(), sin.contiguous()
    tokens, n_q, dim = q.shape
    n_k, half = k.shape[1], dim // 2
    q_out = torch.empty(q.shape, dtype=q.dtype if sums is None else sums[3], device=q.device)
    if tokens == 0:
        return q_out
    norm = q_norm is not None
    if norm and not (q_norm.dtype == k_norm.dtype == q.dtype == k.dtype and q_norm.numel() == k_norm.numel() == dim):
        raise ValueError(f"rotary: head norms of {q_norm.dtype} {tuple(q_norm.shape)} / {k_norm.dtype} "
                         f"{tuple(k_norm.shape)} for heads of {dim} in {q.dtype}: [D] weights in q's dtype")
    k_scale, v_scale = kv_scales if kv_scales is not None else (cos, cos)
    if sums is not None:
        if k_dst.dtype != sums[3] or kv_scales is not None or k_side is not None:
            raise ValueError(f"rotary: an fp8 GEMM's sums go to a cache of the model's {sums[3]}, not {k_dst.dtype}")
        row_scales, channel_scales, bias = sums[0].reshape(-1).float().contiguous(), sums[1].float().contiguous(), \
            sums[2]
    else:
        row_scales = channel_scales = bias = cos
    use_pdl = pdl.enabled(q, "rotary")
    _rotary_kernel[(tokens,)](
        q, k, v, q_out, k_dst, v_dst, q_out if k_side is None else k_side, positions,
        positions if slots is None else slots, cos, sin, q_norm if norm else cos, k_norm if norm else cos, k_scale,
        v_scale, row_scales, channel_scales, cos if bias is None else bias, eps, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), n_q, n_k, cos.stride(0), HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(n_q),
        BLOCK_HK=triton.next_power_of_2(n_k), STORE=slots is not None, NORM=norm, FP8=kv_scales is not None,
        SIDE=k_side is not None, SUMS=sums is not None, HAS_BIAS=sums is not None and bias is not None,
        PDL=pdl.flavor(use_pdl, "rotary"), INTERPRETED=_INTERPRETED, num_warps=4, **COMPILE_OPTIONS,
        launch_pdl=use_pdl)
    return q_out


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D] (any token/head strides, unit dim stride), positions: [T],
    cos/sin: [max_positions, D // 2] (float32, or rounded to the model's dtype). Returns new contiguous tensors."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _rotate(q, k, k, positions, cos, sin, k_out, k_out, None), k_out


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                    eps: float = 0.0, sums: Optional[tuple] = None) -> torch.Tensor:
    """rotary_embedding, then store_kv of the rotated k and v at slots: returns the rotated q; the caches
    [num_slots, Hk, D] (contiguous, the dtype of k and v) receive each token's K/V. q_norm / k_norm ([D], q's
    dtype): each head through RMSNorm with those weights (and eps) before it is rotated. sums: q, k, v are views of
    an fp8 q‖k‖v GEMM's unscaled sums, (row scales [T, 1], channel scales [N], bias [N] or None, the model's dtype)
    what scales them (kernels/fp8_epilogue.py's roundings); the caches hold the model's dtype."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    dtype = k.dtype if sums is None else sums[3]
    assert k_cache.dtype == dtype == v_cache.dtype and k.dtype == v.dtype, "the fused store rounds once, to k's dtype"
    return _rotate(q, k, v, positions, cos, sin, k_cache, v_cache, slots, q_norm, k_norm, eps, sums=sums)


def rotary_store_kv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        k_scale: torch.Tensor, v_scale: torch.Tensor, q_norm: Optional[torch.Tensor] = None,
                        k_norm: Optional[torch.Tensor] = None, eps: float = 0.0,
                        with_k: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """rotary_store_kv into an fp8 (e4m3) cache: the rotated k and v divided by their layer's scale ([] float32)
    and rounded as kernels/fp8.to_fp8 rounds (kernels/kv_fp8.store_kv's values, in one launch instead of ~10
    small ones). Returns (the rotated q, with_k: the rotated k unrounded [T, Hk, D], else None)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert k_cache.dtype == v_cache.dtype == FP8 and k.dtype == v.dtype, "e4m3 caches, k and v of one dtype"
    k_side = torch.empty(k.shape, dtype=k.dtype, device=k.device) if with_k else None
    q_out = _rotate(q, k, v, positions, cos, sin, k_cache, v_cache, slots, q_norm, k_norm, eps,
                    (k_scale.float(), v_scale.float()), k_side)
    return q_out, k_side
