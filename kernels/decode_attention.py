"""Grouped-query decode attention over the token-slot KV cache, by flash decoding.

Stage 1: each sequence's context is cut into `num_splits` equal chunks (whole BLOCK_Ns); a program
owns one chunk of one KV head and loads its keys/values once for all the q heads of that head's
group, writing a partial output and its log-sum-exp. Stage 2 merges the partials per (sequence,
head). With one split (large batches) stage 1 writes the output itself and stage 2 is skipped.
The grid depends only on host ints (batch, heads, num_splits), so it can be captured in a CUDA
graph; the per-sequence lengths are read on the device.

A sliding window (window > 0) makes a sequence's context its last `window` tokens: the splits cut
those instead of the whole row, so nothing before the window is read. Soft-capping (Gemma 2) caps
each score before the softmax.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl, settings
from llaunch.kernels.attention_softcap import softcap as _softcap
from llaunch.kernels.pdl_wait import wait_for_previous_kernel

_LOG2E = 1.4426950408889634
_TARGET_PROGRAMS = 256  # stage-1 programs to aim for: ~2 per SM of an H200 (swept with scripts/bench_kernels.py, removed after 6275284)
_MIN_CHUNK = 64


@triton.jit
def _chunk_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    per_split = (seq_len + num_splits - 1) // num_splits
    return tl.maximum((per_split + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, req_to_slots_ptr, rows_ptr, seq_lens_ptr,
                         mid_o_ptr, mid_lse_ptr, out_ptr, k_scale_ptr, v_scale_ptr, qk_scale, num_splits, q_batch_stride, q_head_stride,
                         out_batch_stride, out_head_stride, cache_tok_stride, cache_head_stride, slots_row_stride,
                         dim, window, cap, GROUP: tl.constexpr, DIRECT: tl.constexpr, UPCAST: tl.constexpr,
                         FP8_KV: tl.constexpr, DOT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # Before the PDL wait, read only what the step's inputs hold (lengths, rows, the slot table:
    # written before its first kernel), so splits past a sequence's end exit instead of holding an SM
    # slot through the wait, and the first tile's slot indices are in flight while it waits (13–21 µs
    # a batch-1 step on an H200 against waiting first).
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    kv_start = 0
    if WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    chunk = _chunk_len(seq_len - kv_start, num_splits, BLOCK_N)
    start = kv_start + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if not DIRECT:
        if start >= end:  # the merge reads only the splits that hold tokens
            return
    slot_row_ptr = req_to_slots_ptr + tl.load(rows_ptr + b).to(tl.int64) * slots_row_stride
    offs_n = start + tl.arange(0, BLOCK_N)
    next_slots = tl.load(slot_row_ptr + offs_n, mask=offs_n < end, other=0).to(tl.int64)
    wait_for_previous_kernel(PDL)  # q and this step's K/V are the previous kernels' writes
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < dim
    q = tl.load(q_ptr + b * q_batch_stride + heads[:, None] * q_head_stride + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:  # the interpreter has no bf16/fp16 dot
        q = q.to(tl.float32)
    elif FP8_KV:  # a 16-bit q's products in fp16 (DOT), whose 10 mantissa bits hold bf16's 7; float32's in float32
        q = q.to(DOT)
    v_scale = 1.0
    if FP8_KV:  # an fp8 cache (kernels/kv_fp8.py): one scale per layer for K, on the scores, and for V, on the output
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        slots = next_slots
        nxt = offs_n + BLOCK_N  # the next tile's slot indices, one tile ahead
        next_slots = tl.load(slot_row_ptr + nxt, mask=nxt < end, other=0).to(tl.int64)
        kv_off = slots[:, None] * cache_tok_stride + kv_head * cache_head_stride + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP8_KV:  # every e4m3 value is exact in fp16 (one conversion for two): the products take them as stored
            k = k.to(DOT)
            v = v.to(DOT)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            qk = _softcap(qk, cap)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if FP8_KV:
        acc = acc * v_scale
    if DIRECT:  # one split: this is the answer (an empty row, graph padding, gives zeros)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * out_batch_stride + heads[:, None] * out_head_stride + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        mid = (b * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [B, Hq, splits] index
        tl.store(mid_o_ptr + mid[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None],
                 mask=h_mask[:, None] & d_mask[None, :])
        tl.store(mid_lse_ptr + mid, m_i + tl.log2(l_i), mask=h_mask)


@triton.jit
def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, seq_lens_ptr, out_ptr, num_splits, out_batch_stride,
                         out_head_stride, dim, window, PDL: tl.constexpr, WINDOW: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    wait_for_previous_kernel(PDL)  # nothing before this reads or writes what an earlier kernel touches
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    if WINDOW:  # the context stage 1 split: the last `window` tokens
        seq_len = tl.minimum(seq_len, window)
    chunk = _chunk_len(seq_len, num_splits, BLOCK_N)
    n_valid = (seq_len + chunk - 1) // chunk  # the splits stage 1 wrote
    base = (b * tl.num_programs(1) + head) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    m_vec = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        lse = tl.load(mid_lse_ptr + base + s0 + offs_s, mask=s0 + offs_s < n_valid, other=float("-inf"))
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, axis=0)
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    weight = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        s_mask = s0 + offs_s < n_valid
        lse = tl.load(mid_lse_ptr + base + s0 + offs_s, mask=s_mask, other=float("-inf"))
        w = tl.exp2(lse - m)
        o = tl.load(mid_o_ptr + (base + s0 + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None],
                    other=0.0)
        total += tl.sum(w[:, None] * o, axis=0)
        weight += w
    # The best split weighs exactly 1, so the clamp only turns an empty row (graph padding) into zeros.
    result = total / tl.maximum(tl.sum(weight, axis=0), 1.0)
    tl.store(out_ptr + b * out_batch_stride + head * out_head_stride + offs_d, result.to(out_ptr.dtype.element_ty),
             mask=offs_d < dim)


def _launch_shape(q: torch.Tensor, dim: int, splits: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of stage 1 for the device, head size and split count. Split
    contexts (small batches: latency-bound) take 64-token tiles, twice the programs on a short
    context: 2–9 µs a batch-1 step faster in three H200 runs (docs/performance.md); one split per
    sequence (large batches, where the KV read is the step) keeps the 128-token tiles it was tuned with."""
    if not q.is_cuda:
        return 32, 4, 1  # interpreter
    if dim > 128:  # Gemma's 256: float32's 128-token tiles need 287 KB of shared memory
        return 64, 4, 2
    return (64 if splits > 1 else 128), 4, 2


def num_splits_for(batch: int, kv_heads: int, max_len: int) -> int:
    """Chunks per sequence: enough programs to fill the GPU, chunks of at least _MIN_CHUNK tokens."""
    return max(1, min(triton.cdiv(max_len, _MIN_CHUNK), triton.cdiv(_TARGET_PROGRAMS, batch * kv_heads)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     req_to_slots: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, *, max_len: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                     v_scale: Optional[torch.Tensor] = None, window: int = 0, softcap: float = 0.0,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, Hq, D] attends to the first seq_lens[b] cached tokens of row rows[b] → [B, Hq, D] (into `out` when
    given); with
    window > 0 to the last `window` of them only; softcap > 0: each score s (after `scale`) becomes
    softcap · tanh(s / softcap). An fp8 cache comes with its layer's k_scale and v_scale ([] float32 tensors).
    `max_len` (host int, default max_model_len) bounds seq_lens; it only sets the split count, so
    it must stay fixed while a CUDA graph replays."""
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride(), "caches: same layout, unit dim stride"
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, n_q_heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1, "out: q's shape, unit dim stride"
    if batch == 0:
        return out
    # kernels.row_invariant: a row's chunks as in any other step, whatever its rows and their longest context
    # (a verify step's rows as batch-1 decode's, an eager step's as a graph's): the KV rows' length, one row. Steps
    # of more than settings.INVARIANT_ROWS rows are not invariant (cuBLAS sums their linears), so they keep the
    # batch's split (one row's at batch 256: 65k programs and 235 MB of partial sums a Qwen2-7B layer)
    invariant = settings.invariant_step(batch)
    longest = max_len if max_len is not None and not invariant else req_to_slots.shape[1]
    rows_for_split = 1 if invariant else batch
    splits = num_splits_for(rows_for_split, kv_heads, min(longest, window) if window > 0 else longest)
    block_d = triton.next_power_of_2(dim)
    group = n_q_heads // kv_heads
    direct = splits == 1
    mid_shape = (1, 1, 1) if direct else (batch, n_q_heads, splits)
    mid_o = torch.empty((*mid_shape, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    block_n, warps, stages = _launch_shape(q, dim, splits)
    use_pdl = pdl.enabled(q, "decode_attention")
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, req_to_slots, rows, seq_lens, mid_o, mid_lse, out,
        k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale, scale * _LOG2E, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        req_to_slots.stride(0), dim, window, softcap * _LOG2E, GROUP=group, DIRECT=direct, UPCAST=not q.is_cuda,
        FP8_KV=k_scale is not None, DOT=tl.float32 if q.dtype == torch.float32 or not q.is_cuda else tl.float16,
        WINDOW=window > 0, SOFTCAP=softcap > 0,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl.flavor(use_pdl, "decode_attention"),
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps,
        num_stages=stages, launch_pdl=use_pdl)
    if not direct:
        _decode_merge_kernel[(batch, n_q_heads)](
            mid_o, mid_lse, seq_lens, out, splits, out.stride(0), out.stride(1), dim, window,
            PDL=pdl.flavor(use_pdl, "decode_attention"), WINDOW=window > 0,
            BLOCK_S=min(16, triton.next_power_of_2(splits)), BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4,
            launch_pdl=use_pdl)
    return out
