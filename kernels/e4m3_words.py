"""The dot products of an fp8 one-row layer's program over its e4m3 weights read as 32-bit words (4 weights a
word), for a layer whose x is quantized too (dynamic or static activation scales) in a bfloat16 model
(kernels.fp8_words; kernels/gemv.words_for).

Why words: row_dots converts each e4m3 weight to float32 before its FMA, and Triton's lowering of that takes
each byte out of the loaded vector and packs pairs back together for the e4m3x2 → f16x2 conversion: its sm90
loop spends ~9 instructions a weight a thread (8/512/4, dynamic x), and on the H200 the register kernel read
qkv's and o_proj's weights at 1.7 TB/s, half the bf16 GEMV's bytes a second on the same shapes. Here a word's
two halves go straight to `cvt.rn.f16x2.e4m3x2` and each pair of products is one `fma.rn.f16x2` (4
instructions for 4 weights; built as launched, the strides multiples of 16, the sm90 loop at 8/512/4 is 116
instructions a tile a thread, 3.6 a weight: two 128-bit weight loads, 16 conversions, 16 FMAs, the rest x's
quantization, shared between threads through shared memory, 4 barriers a tile). Both factors are e4m3
values (x's after its scale, times 2^-8 so that no product passes 784), so a product is exact in float16 (but
for float16's subnormals, below 2^-14); float16 sums run over at most WORD_RUN tiles (2 products a lane a tile:
≤ 2 · 8 · 784, far from 65,504) before float32 takes them.

Under the interpreter the same sums come from plain float16 ops (a product, then a sum: the product is exact,
so the FMA's single rounding is the same), the even and odd lanes apart."""
from __future__ import annotations

import triton
import triton.language as tl

from llaunch.kernels.e4m3 import quantized, quotient_rn, row_scale
from llaunch.kernels.pdl_wait import wait_for_previous_kernel
from llaunch.kernels.split_k import k_share

# x's e4m3 values (≤ 448) are multiplied by 2^-8 (a product with a weight ≤ 784), the float32 sums by 2^8; float16
# sums run over WORD_RUN tiles before float32 takes them (word_dots' RUN)
WORD_RUN = 8

# acc(f16x2) += lo(w) * x01 + hi(w) * x23, w a word of 4 e4m3 weights, x01 / x23 f16x2 pairs of x
_FMA_WORD = tl.constexpr("""{
    .reg .b16 lo, hi;
    .reg .b32 a, b;
    mov.b32 {lo, hi}, $1;
    cvt.rn.f16x2.e4m3x2 a, lo;
    cvt.rn.f16x2.e4m3x2 b, hi;
    fma.rn.f16x2 $0, a, $2, $4;
    fma.rn.f16x2 $0, b, $3, $0;
}""")


@triton.jit
def _x_columns(x_ptr, cols, K, x_scale, x_rcp, INTERPRETED: tl.constexpr):
    """x's 4 columns of each word (columns `cols` + 0..3, one load a word), each quantized to e4m3 by x_scale, times
    2^-8, as float16 (exact): four [W] tensors. On the GPU x / x_scale is div.rn's fast path (a product with the
    reciprocal x_rcp = 1 / x_scale, taken once, then one correction by FMA: the correctly rounded quotient wherever
    div.rn does not leave that path, which x's range never makes it), without a reciprocal and a range check a
    value; under the interpreter e4m3.quantized (its division)."""
    at = cols[:, None] + tl.arange(0, 4)[None, :]
    x = tl.load(x_ptr + at, mask=at < K, other=0.0).to(tl.float32)
    if INTERPRETED:
        q = quantized(x, x_scale, True)
    else:
        q = tl.clamp(quotient_rn(x, x_scale, x_rcp), -448.0, 448.0).to(tl.float8e4nv).to(tl.float32)
    quads = (q * 0.00390625).to(tl.float16).reshape(cols.shape[0], 2, 2)  # [word, pair, column of the pair]
    first, second = tl.split(quads)  # columns 0, 2 and 1, 3
    x0, x2 = tl.split(first)
    x1, x3 = tl.split(second)
    return x0, x1, x2, x3


@triton.jit
def _pair(lo, hi):
    """Two float16 tensors as f16x2 words (lo in the low half)."""
    lo_bits = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.int16, bitcast=True).to(tl.int32)
    return lo_bits | (hi_bits << 16)


@triton.jit
def _halves_sum(words):
    """f16x2 words → the float32 sum of their two halves."""
    lo = (words & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (words >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo + hi


@triton.jit
def _byte_half(words, shift: tl.constexpr):
    """The e4m3 byte `shift` bits up in each word, as float16."""
    return ((words >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def word_dots(x_ptr, w_words, row_mask, K, up_offset_words, GATED: tl.constexpr, PDL: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, x_scale=1.0, ROW_SCALE: tl.constexpr = False,
              scale_ub=0.0, HAS_UB: tl.constexpr = False, AMAX_BLOCK: tl.constexpr = 1024,
              INTERPRETED: tl.constexpr = False, RUN: tl.constexpr = WORD_RUN, SPLIT: tl.constexpr = 1):
    """row_dots' sums (and x_scale) for e4m3 weights with QUANT_X, K a multiple of 4: w_words points at each
    row's first word (int32), up_offset_words the up rows' distance in words. BLOCK_K columns a tile
    (BLOCK_K / 4 words). SPLIT > 1: the sums over this program's share of K alone (split_k.k_share: whole tiles,
    program_id(1) of SPLIT); x's scale is still its absmax over all of K."""
    W: tl.constexpr = BLOCK_K // 4
    k_begin, k_end = k_share(K, BLOCK_K, SPLIT)
    w_begin = k_begin // 4
    K4 = k_end // 4
    words = w_begin + tl.arange(0, W)
    mask = row_mask[:, None] & (words < K4)[None, :]
    w = tl.load(w_rows_at(w_words, words), mask=mask, other=0, eviction_policy="evict_first")
    up = w
    if GATED:
        up = tl.load(w_rows_at(w_words + up_offset_words, words), mask=mask, other=0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)
    if ROW_SCALE:
        x_scale = row_scale(x_ptr, K, scale_ub, HAS_UB, AMAX_BLOCK)
    x_rcp = tl.math.div_rn(1.0, x_scale)
    acc = tl.zeros([BLOCK_N, W], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, W], dtype=tl.float32)
    if INTERPRETED:  # the even and odd lanes as float16 tensors
        even = tl.zeros([BLOCK_N, W], dtype=tl.float16)
        odd = tl.zeros([BLOCK_N, W], dtype=tl.float16)
        up_even = tl.zeros([BLOCK_N, W], dtype=tl.float16)
        up_odd = tl.zeros([BLOCK_N, W], dtype=tl.float16)
    else:
        half = tl.zeros([BLOCK_N, W], dtype=tl.int32)
        up_half = tl.zeros([BLOCK_N, W], dtype=tl.int32)
    words = tl.arange(0, W)
    for w0 in range(w_begin, K4, W):
        cols = (w0 + words) * 4
        nxt = w0 + W + words
        mask = row_mask[:, None] & (nxt < K4)[None, :]  # all false after the last tile: no traffic
        w_next = tl.load(w_rows_at(w_words, nxt), mask=mask, other=0, eviction_policy="evict_first")
        if GATED:
            up_next = tl.load(w_rows_at(w_words + up_offset_words, nxt), mask=mask, other=0,
                              eviction_policy="evict_first")
        x0, x1, x2, x3 = _x_columns(x_ptr, cols, K, x_scale, x_rcp, INTERPRETED)
        if INTERPRETED:
            x0, x1, x2, x3 = x0[None, :], x1[None, :], x2[None, :], x3[None, :]
            even = (even + _byte_half(w, 0) * x0) + _byte_half(w, 16) * x2
            odd = (odd + _byte_half(w, 8) * x1) + _byte_half(w, 24) * x3
            if GATED:
                up_even = (up_even + _byte_half(up, 0) * x0) + _byte_half(up, 16) * x2
                up_odd = (up_odd + _byte_half(up, 8) * x1) + _byte_half(up, 24) * x3
        else:
            x01 = tl.broadcast_to(_pair(x0, x1)[None, :], [BLOCK_N, W])
            x23 = tl.broadcast_to(_pair(x2, x3)[None, :], [BLOCK_N, W])
            half = tl.inline_asm_elementwise(_FMA_WORD, "=r,r,r,r,r", [w, x01, x23, half], dtype=tl.int32,
                                             is_pure=True, pack=1)
            if GATED:
                up_half = tl.inline_asm_elementwise(_FMA_WORD, "=r,r,r,r,r", [up, x01, x23, up_half],
                                                    dtype=tl.int32, is_pure=True, pack=1)
        w = w_next
        if GATED:
            up = up_next
        if ((w0 - w_begin) // W) % RUN == RUN - 1:  # the run's float16 sums into float32
            if INTERPRETED:
                acc += even.to(tl.float32) + odd.to(tl.float32)
                even = tl.zeros([BLOCK_N, W], dtype=tl.float16)
                odd = tl.zeros([BLOCK_N, W], dtype=tl.float16)
                if GATED:
                    up_acc += up_even.to(tl.float32) + up_odd.to(tl.float32)
                    up_even = tl.zeros([BLOCK_N, W], dtype=tl.float16)
                    up_odd = tl.zeros([BLOCK_N, W], dtype=tl.float16)
            else:
                acc += _halves_sum(half)
                half = tl.zeros([BLOCK_N, W], dtype=tl.int32)
                if GATED:
                    up_acc += _halves_sum(up_half)
                    up_half = tl.zeros([BLOCK_N, W], dtype=tl.int32)
    if INTERPRETED:
        acc += even.to(tl.float32) + odd.to(tl.float32)
        up_acc += up_even.to(tl.float32) + up_odd.to(tl.float32)
    else:
        acc += _halves_sum(half)
        up_acc += _halves_sum(up_half)
    return tl.sum(acc, axis=1) * 256.0, tl.sum(up_acc, axis=1) * 256.0, x_scale


@triton.jit
def w_rows_at(w_words, words):
    return w_words[:, None] + words[None, :]
