"""Causal flash attention for variable-length prefill chunks over the token-slot KV cache.

Sequence i's chunk q[q_starts[i] : q_starts[i] + q_lens[i]] sits at positions prefix_lens[i].. and
attends to the first prefix_lens[i] + q_lens[i] tokens of its req_to_slots row (its own new K/V are
already stored). A program owns BLOCK_M queries of one head of one sequence; keys before the block's
first query are visible to all its rows and run unmasked, only the diagonal blocks are masked.

A sliding window (window > 0: Mistral, Gemma's local layers) lets the query at position p see keys
p - window + 1 .. p only: the loop starts at the first block any row of the program sees, and the
blocks some rows see only in part are masked too. Soft-capping (Gemma 2) caps each score before the mask.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels.attention_softcap import softcap as _softcap

_LOG2E = 1.4426950408889634


# Where a block's keys and values come from (_attend_block's SOURCE): the cache (16-bit as stored; fp8: its e4m3 values
# exact in DOT, the layer's scales on the scores and on the block's output), the chunk's own k_new / v_new alone (fp8
# with FRESH: blocks past the cached prefix), or both (the block the prefix ends in, the masked ones: each key from
# where it lies, the cache's dequantized in q's dtype as the reference does)
CACHE = tl.constexpr(0)
NEW = tl.constexpr(1)
MIXED = tl.constexpr(2)


@triton.jit
def _attend_block(acc, m_i, l_i, q, q_dot, k_cache_ptr, v_cache_ptr, slot_row_ptr, start_n, kv_end, q_pos,
                  kv_head, offs_d, dim, qk_scale, cache_tok_stride, cache_head_stride, k_scale, v_scale,
                  k_new_ptr, v_new_ptr, new_tok_stride, new_head_stride, prefix, q_start, window, cap,
                  MASKED: tl.constexpr, UPCAST: tl.constexpr, FP8_KV: tl.constexpr, SOURCE: tl.constexpr,
                  WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    d_mask = offs_d[None, :] < dim
    if MASKED:
        n_mask = offs_n < kv_end
        kv_mask = n_mask[:, None] & d_mask
    else:
        kv_mask = d_mask
    new_off = (q_start + offs_n - prefix)[:, None] * new_tok_stride + kv_head * new_head_stride + offs_d[None, :]
    if SOURCE != NEW:
        if MASKED:
            slots = tl.load(slot_row_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
        else:
            slots = tl.load(slot_row_ptr + offs_n).to(tl.int64)
        kv_off = slots[:, None] * cache_tok_stride + kv_head * cache_head_stride + offs_d[None, :]
    scores_scale = qk_scale
    if SOURCE == MIXED:  # the chunk's own keys from k_new/v_new (unrounded), the prefix's from the fp8 cache
        cached = (offs_n < prefix)[:, None]
        kc = tl.load(k_cache_ptr + kv_off, mask=kv_mask & cached, other=0.0).to(tl.float32) * k_scale
        vc = tl.load(v_cache_ptr + kv_off, mask=kv_mask & cached, other=0.0).to(tl.float32) * v_scale
        kf = tl.load(k_new_ptr + new_off, mask=kv_mask & (offs_n >= prefix)[:, None], other=0.0).to(tl.float32)
        vf = tl.load(v_new_ptr + new_off, mask=kv_mask & (offs_n >= prefix)[:, None], other=0.0).to(tl.float32)
        k = tl.where(cached, kc.to(k_new_ptr.dtype.element_ty).to(tl.float32), kf).to(q.dtype)
        v = tl.where(cached, vc.to(v_new_ptr.dtype.element_ty).to(tl.float32), vf).to(q.dtype)
    elif SOURCE == NEW:
        k = tl.load(k_new_ptr + new_off, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_new_ptr + new_off, mask=kv_mask, other=0.0).to(q.dtype)
    else:
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    e4m3: tl.constexpr = FP8_KV and SOURCE == CACHE
    if e4m3:  # every e4m3 value is exact in DOT (fp16 for a 16-bit q: one conversion for two), taken as stored
        k = k.to(DOT)
        v = v.to(DOT)
        scores_scale = qk_scale * k_scale
    elif UPCAST:  # the interpreter has no bf16/fp16 dot
        k = k.to(tl.float32)
    if e4m3:
        qk = tl.dot(q_dot, tl.trans(k), input_precision=PRECISION) * scores_scale
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scores_scale
    if SOFTCAP:
        qk = _softcap(qk, cap)
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < kv_end)
        if WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    if WINDOW:  # a row may see nothing of a block before its window: keep its (empty) sums at 0, not NaN
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if e4m3:
        pv = tl.dot(p.to(DOT), v, input_precision=PRECISION) * v_scale
    elif UPCAST:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, req_to_slots_ptr, rows_ptr, q_starts_ptr,
                    q_lens_ptr, prefix_lens_ptr, k_scale_ptr, v_scale_ptr, qk_scale, q_tok_stride, q_head_stride, out_tok_stride,
                    out_head_stride, cache_tok_stride, cache_head_stride, slots_row_stride, dim,
                    k_new_ptr, v_new_ptr, new_tok_stride, new_head_stride, window, cap, FRESH: tl.constexpr,
                    GROUP: tl.constexpr, UPCAST: tl.constexpr, FP8_KV: tl.constexpr, WINDOW: tl.constexpr,
                    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (last) blocks first
    seq = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + seq)
    if m_block * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)
    prefix = tl.load(prefix_lens_ptr + seq)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    q_tok = q_start + offs_m
    q = tl.load(q_ptr + q_tok[:, None] * q_tok_stride + head * q_head_stride + offs_d[None, :],
                mask=m_mask[:, None] & (offs_d[None, :] < dim), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_dot = q
    if FP8_KV:  # for the e4m3 cache's blocks: a 16-bit q in fp16 (DOT), whose 10 mantissa bits hold bf16's 7 (as
        q_dot = q.to(DOT)  # decode attention's: |q| past fp16's 65,504 would not be; attention queries stay far below)
    q_pos = prefix + offs_m
    k_scale = 1.0
    v_scale = 1.0
    if FP8_KV:  # one scale per layer for K and for V (kernels/kv_fp8.py)
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    slot_row_ptr = req_to_slots_ptr + row * slots_row_stride
    kv_end = prefix + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    first_q = prefix + m_block * BLOCK_M
    full_end = (first_q // BLOCK_N) * BLOCK_N  # keys before every row of the block: causally visible to all
    win_start = 0  # the first block any row sees
    win_end = 0  # from here to full_end every row sees every key (all inside each row's window)
    if WINDOW:
        win_start = (tl.maximum(first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
        win_end = ((tl.maximum(kv_end - window, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        win_end = tl.minimum(tl.maximum(win_end, win_start), full_end)
    # the masked blocks (the window's lower edge, the diagonal) read both sources where the chunk brings its own K/V
    EDGE: tl.constexpr = MIXED if FRESH else CACHE
    for start_n in range(win_start, win_end, BLOCK_N):  # the window's lower edge: masked
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_dot, k_cache_ptr, v_cache_ptr, slot_row_ptr, start_n,
                                      kv_end, q_pos, kv_head, offs_d, dim, qk_scale, cache_tok_stride,
                                      cache_head_stride, k_scale, v_scale, k_new_ptr, v_new_ptr, new_tok_stride,
                                      new_head_stride, prefix, q_start, window, cap, True, UPCAST, FP8_KV, EDGE,
                                      WINDOW, SOFTCAP, PRECISION, DOT, BLOCK_N)
    # the unmasked blocks: the cached prefix's whole blocks, the block it ends in, then the chunk's own whole blocks
    # (without FRESH every key is in the cache)
    cached_end = full_end
    new_start = full_end
    if FRESH:
        cached_end = tl.minimum(tl.maximum((prefix // BLOCK_N) * BLOCK_N, win_end), full_end)
        new_start = tl.minimum(tl.maximum(((prefix + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, cached_end), full_end)
    for start_n in range(win_end, cached_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_dot, k_cache_ptr, v_cache_ptr, slot_row_ptr, start_n,
                                      kv_end, q_pos, kv_head, offs_d, dim, qk_scale, cache_tok_stride,
                                      cache_head_stride, k_scale, v_scale, k_new_ptr, v_new_ptr, new_tok_stride,
                                      new_head_stride, prefix, q_start, window, cap, False, UPCAST, FP8_KV, CACHE,
                                      WINDOW, SOFTCAP, PRECISION, DOT, BLOCK_N)
    for start_n in range(cached_end, new_start, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_dot, k_cache_ptr, v_cache_ptr, slot_row_ptr, start_n,
                                      kv_end, q_pos, kv_head, offs_d, dim, qk_scale, cache_tok_stride,
                                      cache_head_stride, k_scale, v_scale, k_new_ptr, v_new_ptr, new_tok_stride,
                                      new_head_stride, prefix, q_start, window, cap, False, UPCAST, FP8_KV, MIXED,
                                      WINDOW, SOFTCAP, PRECISION, DOT, BLOCK_N)
    for start_n in range(new_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_dot, k_cache_ptr, v_cache_ptr, slot_row_ptr, start_n,
                                      kv_end, q_pos, kv_head, offs_d, dim, qk_scale, cache_tok_stride,
                                      cache_head_stride, k_scale, v_scale, k_new_ptr, v_new_ptr, new_tok_stride,
                                      new_head_stride, prefix, q_start, window, cap, False, UPCAST, FP8_KV, NEW,
                                      WINDOW, SOFTCAP, PRECISION, DOT, BLOCK_N)
    for start_n in range(full_end, kv_end, BLOCK_N):  # the diagonal: masked
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_dot, k_cache_ptr, v_cache_ptr, slot_row_ptr, start_n,
                                      kv_end, q_pos, kv_head, offs_d, dim, qk_scale, cache_tok_stride,
                                      cache_head_stride, k_scale, v_scale, k_new_ptr, v_new_ptr, new_tok_stride,
                                      new_head_stride, prefix, q_start, window, cap, True, UPCAST, FP8_KV, EDGE,
                                      WINDOW, SOFTCAP, PRECISION, DOT, BLOCK_N)
    if WINDOW:  # rows past the chunk's end may see no key at all
        l_i = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_i[:, None]
    tl.store(out_ptr + q_tok[:, None] * out_tok_stride + head * out_head_stride + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_d[None, :] < dim))


def _launch_shape(q: torch.Tensor, dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the device, dtype and head size. Each must fit an
    H200's 227 KB of shared memory a program (tests/kernels/test_sm90_builds.py compiles them all)."""
    if not q.is_cuda:
        return 64, 64, 4, 1  # interpreter: few, large programs
    if q.dtype == torch.float32:  # 4-byte tiles: the 16-bit shapes of dim 128 need 257 KB (IEEE) or 385 KB
        if dim > 128:  # Gemma's 256: 64 x 64 tiles need 262 KB
            return 32, 32, 4, 2
        return (128, 64, 4, 3) if dim <= 64 else (64, 64, 4, 2)
    if dim <= 64:
        return 128, 64, 4, 3
    if dim > 128:  # Gemma's 256 (98 KB; the 128 x 128 tiles fit too, in 197 KB, with twice the registers): not swept
        return 64, 64, 8, 2
    return 128, 128, 8, 3  # best of the sweep in scripts/bench_kernels.py on an H200 (removed after 6275284)


def _precision(q: torch.Tensor) -> str:
    """tl.dot's input precision. float32 on a GPU: three TF32 products per product (tensor cores,
    float32-level error: 1.1e-6 from the IEEE reference for a 512-token SmolLM2 prompt on an H200, in
    0.088 ms a layer where IEEE dots took 2.27 ms, 68 ms of its 78 ms TTFT). 16-bit inputs: their own
    tensor-core dot ("tf32" is ignored)."""
    if q.dtype != torch.float32:
        return "tf32"
    return "tf32x3" if q.is_cuda else "ieee"


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      req_to_slots: torch.Tensor, rows: torch.Tensor, q_starts: torch.Tensor,
                      q_lens: torch.Tensor, prefix_lens: torch.Tensor, scale: float,
                      *, max_q_len: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                      v_scale: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
                      v_new: Optional[torch.Tensor] = None, window: int = 0, softcap: float = 0.0,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: [T, Hq, D] → [T, Hq, D] (into `out` when given: rows no chunk covers keep what they held). `max_q_len` (host int) bounds q_lens to size the grid; without it
    the grid covers T tokens per sequence and the surplus programs exit at once (no device sync).
    An fp8 cache comes with its layer's k_scale and v_scale ([] float32 tensors), and may come with
    the chunk's own k_new, v_new ([T, Hk, D], indexed as q: read for the chunk instead of the cache).
    window > 0: a query sees only the last `window` positions (itself included); softcap > 0: each
    score s (after `scale`) becomes softcap · tanh(s / softcap)."""
    if k_new is not None:  # one layout for both (v is a strided view of the qkv output)
        assert k_scale is not None
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride(), "caches: same layout, unit dim stride"
    if q.stride(-1) != 1:
        q = q.contiguous()
    tokens, n_q_heads, dim = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1, "out: q's shape, unit dim stride"
    batch = rows.shape[0]
    if tokens == 0 or batch == 0:
        return out
    block_m, block_n, warps, stages = _launch_shape(q, dim)
    grid = (n_q_heads, triton.cdiv(max_q_len if max_q_len is not None else tokens, block_m), batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, req_to_slots, rows, q_starts, q_lens, prefix_lens,
        k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        req_to_slots.stride(0), dim, k_cache if k_new is None else k_new, v_cache if v_new is None else v_new,
        0 if k_new is None else k_new.stride(0), 0 if k_new is None else k_new.stride(1), window,
        softcap * _LOG2E, FRESH=k_new is not None, GROUP=n_q_heads // k_cache.shape[1], UPCAST=not q.is_cuda,
        FP8_KV=k_scale is not None, WINDOW=window > 0, SOFTCAP=softcap > 0,
        PRECISION=_precision(q), DOT=tl.float32 if q.dtype == torch.float32 or not q.is_cuda else tl.float16,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(dim), num_warps=warps, num_stages=stages)
    return out
