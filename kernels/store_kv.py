"""Scatter each new token's K and V [Hk, D] into its cache slot: a program per token, one contiguous
Hk*D write per cache."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_token(src_ptr, dst_ptr, token, slot, src_tok_stride, src_head_stride, n_heads, dim,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < dim)
    x = tl.load(src_ptr + token * src_tok_stride + heads * src_head_stride + dims, mask=mask)
    tl.store(dst_ptr + slot * n_heads * dim + heads * dim + dims, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_tok_stride, k_head_stride,
                     v_tok_stride, v_head_stride, n_heads, dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    _copy_token(k_ptr, k_cache_ptr, token, slot, k_tok_stride, k_head_stride, n_heads, dim, BLOCK_H, BLOCK_D)
    _copy_token(v_ptr, v_cache_ptr, token, slot, v_tok_stride, v_head_stride, n_heads, dim, BLOCK_H, BLOCK_D)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write new keys/values [T, Hk, D] (any token/head strides) into contiguous caches
    [num_slots, Hk, D] at slots [T]."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    tokens, n_heads, dim = k.shape
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), n_heads, dim,
        BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(dim), num_warps=4)
