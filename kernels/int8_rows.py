"""Products with int8 weight rows: the LM head (model.int8_lm_head) and, with model.quantization=int8, the decoder's
linears. Each weight row (a vocabulary row, an output channel) rounded to int8 with a float32 scale of its own
(symmetric, round to nearest: row absmax / 127), the inputs left in the model's dtype (weight-only). Half the bytes
of a 16-bit head, which a batch-1 decode step reads whole every token (Qwen2-7B's: 1.09 GB of bf16 against ~6.5 GB of
fp8 body weights). Why int8 and not e4m3 (model.fp8_lm_head): over SmolLM2's 2,048 positions of this repository's docs
(`scripts/fp8_accuracy.py`) the fp8 body with an int8 head agrees with float32 on 87.9% of the top-1 tokens against
its 88.5% with the 16-bit head; with the head in e4m3 80.7%, and int8 inputs as well (W8A8) 84.7%. An int8 value is
exact in bfloat16 and float16 (8 significant bits), so the products are exact in float32 and the sums differ from
the reference's (kernels/int8.py, which also quantizes) only in their order. The decoder's linears the same way
(model.quantization=int8, `linear`: outputs in x's dtype, a bias added before that rounding): SmolLM2's bf16 model
with them 94.8% against its 96.8%, where e4m3 (model.quantization=fp8) serves 88.5%.

One kernel, two paths by the step's rows: one row (batch-1 decode; each row alike under kernels.row_invariant) on the
CUDA cores, each program a tile of vocabulary rows read once as 32-bit words, every weight made float32 by a byte
permute and one add (_weight_of: the sm90 loop at 16/512/8 is ~4.9 instructions a weight, against ~5.9 with Triton's
own byte extraction; at 2.85 TB/s on an H100 it is near the e4m3 head's 2.88), or as bytes where K is not a multiple
of 4; more rows on the tensor cores, each weight tile converted to x's dtype (Triton's conversion: two LOP3s, a PRMT
and an HADD2 a pair on sm90) and multiplied with float32 sums: up to 16 rows as x·wᵀ, more as w·xᵀ with all the
step's rows (up to 256) in one tile, converting each weight once. The row scale and the rounding to x's dtype in the
epilogue; the logits come back float32 (as lm_head_linear's other paths: the x-dtype value widened). The launch
shapes: the module's constants below (`scripts/bench_lm_head.py` times others).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl, settings
from llaunch.kernels.int8 import Int8Rows
from llaunch.kernels.pdl_wait import wait_for_previous_kernel

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES): one row on the CUDA cores (BLOCK_M 1), up to 16 rows on the tensor
# cores, and more there with the weights as the MMA's first operand, BLOCK_M the most rows a program takes (fewer: the
# step's rows to a power of two). d50ce77, H100, the head alone (Qwen2-7B's, bench_lm_head.py): one row 0.200 ms at
# 16/512/8, 0.191 at 32/256/8 (2.85 TB/s); 16 rows 0.208; 64 and 256 rows 0.335 and 1.198 ms as 64-row tiles of x
# against weight tiles converted again for each (bf16's head 0.396 and 0.460), hence one tile of up to 256 rows
ONE_ROW_SHAPE = (1, 32, 256, 8, 0)
FEW_ROWS_SHAPE = (16, 64, 128, 4, 4)
MANY_ROWS_SHAPE = (256, 128, 64, 8, 3)
# A decoder linear's (model.quantization=int8): N of a few thousand outputs makes few programs of the head's tiles
# (Qwen2-7B's o_proj: 112 one-row programs of 32 rows for 132 SMs): narrower ones, as the fp8 word GEMV's 8/512/4, and
# x as the MMA's first operand up to LAYER_ROWS rows (the swapped tile's 64-row minimum of weights would leave 56
# programs); past them (a prefill) the many-rows tile, its row tiles multiplying the programs. Not yet measured on a GPU
LAYER_SHAPES = ((1, 8, 512, 4, 0), (16, 16, 128, 4, 4), (64, 32, 128, 4, 3))
LAYER_ROWS = 256
INTERPRETED_SHAPES = ((1, 4, 64, 4, 0), (16, 16, 32, 4, 1), (32, 16, 32, 4, 1))
INTERPRETED_LAYER_SHAPES = ((1, 8, 64, 4, 0), (16, 16, 32, 4, 1), (32, 16, 32, 4, 1))
INTERPRETED_LAYER_ROWS = 64


# int8 → float32 without a conversion instruction: a byte b + 128 (the word XOR 0x80 in each byte) as the low mantissa
# byte of 2^23 is the float 2^23 + b + 128, exact; subtracting 2^23 + 128 leaves b (a byte permute and one add a weight
# where Triton's conversion takes a byte extraction and an I2F, at the conversion unit's quarter rate)
_SIGN_BITS = tl.constexpr(-2139062144)  # 0x80808080 as an int32
_TWO_23 = tl.constexpr(1258291200)  # 0x4B000000: the float 2^23's bits
_OFFSET = tl.constexpr(8388736.0)  # 2^23 + 128


# byte i of a word under 0x4B's float exponent byte, in one byte permute (prmt: the result's bytes low to high are the
# word's byte i, two zero bytes and 0x4B; Triton's shifts, masks and OR take three instructions)
_BYTE_0, _BYTE_1, _BYTE_2, _BYTE_3 = (
    tl.constexpr(f"{{ .reg .b32 t; mov.b32 t, 0x4B000000; prmt.b32 $0, $1, t, 0x744{i}; }}") for i in range(4))


@triton.jit
def _under_2_23(biased, i: tl.constexpr):
    if i == 0:
        asm: tl.constexpr = _BYTE_0
    elif i == 1:
        asm: tl.constexpr = _BYTE_1
    elif i == 2:
        asm: tl.constexpr = _BYTE_2
    else:
        asm: tl.constexpr = _BYTE_3
    return tl.inline_asm_elementwise(asm, "=r,r", [biased], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _weight_of(biased, i: tl.constexpr, INTERPRETED: tl.constexpr):
    """The int8 weight in byte i of each word of `biased` (its bytes XOR 0x80) as float32."""
    if INTERPRETED:
        bits = ((biased >> (8 * i)) & 0xFF) | _TWO_23
    else:
        bits = _under_2_23(biased, i)
    return bits.to(tl.float32, bitcast=True) - _OFFSET


@triton.jit
def _word_dots(x_ptr, w_ptr, rows, row_mask, K, w_stride, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """Σ_k w[r, k]·x[k] in float32 for a program's rows, K a multiple of 4 and each row's start 4-byte aligned: the
    weights loaded as int32 words (4 a word, BLOCK_K / 4 words a tile), each converted by _weight_of, x's 4 columns of
    each word loaded once and used by all BLOCK_N rows."""
    W: tl.constexpr = BLOCK_K // 4
    K4 = K // 4
    words = tl.arange(0, W)
    w_words = (w_ptr + rows.to(tl.int64) * w_stride).to(tl.pointer_type(tl.int32), bitcast=True)
    mask = row_mask[:, None] & (words < K4)[None, :]
    w = tl.load(w_words[:, None] + words[None, :], mask=mask, other=0, eviction_policy="evict_first")
    wait_for_previous_kernel(PDL)  # the weights are constants: the first tile is requested before x is ready
    acc = tl.zeros([BLOCK_N, W], dtype=tl.float32)
    for w0 in range(0, K4, W):
        at = (w0 + words)[:, None] * 4 + tl.arange(0, 4)[None, :]
        quads = tl.load(x_ptr + at, mask=at < K, other=0.0).to(tl.float32).reshape(W, 2, 2)
        first, second = tl.split(quads)  # columns 0, 2 and 1, 3 of each word
        x0, x2 = tl.split(first)
        x1, x3 = tl.split(second)
        nxt = w0 + W + words
        mask = row_mask[:, None] & (nxt < K4)[None, :]  # all false after the last tile: no traffic
        w_next = tl.load(w_words[:, None] + nxt[None, :], mask=mask, other=0, eviction_policy="evict_first")
        biased = w ^ _SIGN_BITS
        acc += (_weight_of(biased, 0, INTERPRETED) * x0[None, :] + _weight_of(biased, 1, INTERPRETED) * x1[None, :]
                + _weight_of(biased, 2, INTERPRETED) * x2[None, :] + _weight_of(biased, 3, INTERPRETED) * x3[None, :])
        w = w_next
    return tl.sum(acc, axis=1)


@triton.jit
def _tile_products(acc, x, w, SWAP: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + x·wᵀ, x [BLOCK_M, BLOCK_K] in the model's dtype, w [BLOCK_N, BLOCK_K] int8 (exact in any float type); or,
    SWAP, acc + w·xᵀ (acc [BLOCK_N, BLOCK_M])."""
    if INTERPRETED:  # the interpreter's dot in float32 (bf16 there is not exact)
        x = x.to(tl.float32)
    if IEEE or INTERPRETED:
        w = w.to(tl.float32)
    else:
        w = w.to(x.dtype)
    if SWAP:
        a = w
        b = tl.trans(x)
    else:
        a = x
        b = tl.trans(w)
    if IEEE:  # a float32 model: float32 products, not TF32's
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _rows_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                 IEEE: tl.constexpr, WORDS: tl.constexpr, INTERPRETED: tl.constexpr, SWAP: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    # one axis, x's row tiles varying fastest: the programs reading one weight tile run together, and all but the
    # first find it in L2 (one axis: a vocabulary's tiles may pass the 65,535 of a grid's second)
    row_tiles = tl.cdiv(M, BLOCK_M)
    row_tile = tl.program_id(0) % row_tiles
    rows = (tl.program_id(0) // row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # vocabulary rows (the logits' columns)
    row_mask = rows < N
    w_rows = w_ptr + rows.to(tl.int64) * w_stride
    cols = tl.arange(0, BLOCK_K)
    m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    x_rows = x_ptr + m.to(tl.int64) * x_stride
    if BLOCK_M == 1 and WORDS:  # a row alone, the weights read as 32-bit words of 4 (see _word_dots)
        y = _word_dots(x_ptr + row_tile.to(tl.int64) * x_stride, w_ptr, rows, row_mask, K, w_stride, PDL,
                       BLOCK_N, BLOCK_K, INTERPRETED)
        y = (y * tl.load(s_ptr + rows, mask=row_mask, other=0.0))[None, :]
    elif BLOCK_M == 1:  # a row (row_tile) alone: each weight to float32, times the row, summed per vocabulary row
        x_ptr += row_tile.to(tl.int64) * x_stride
        mask = row_mask[:, None] & (cols < K)[None, :]
        w = tl.load(w_rows[:, None] + cols[None, :], mask=mask, other=0, eviction_policy="evict_first")
        wait_for_previous_kernel(PDL)  # the weights are constants: the first tile is requested before x is ready
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            nxt = k0 + BLOCK_K + cols
            mask = row_mask[:, None] & (nxt < K)[None, :]  # all false after the last tile: no traffic
            w_next = tl.load(w_rows[:, None] + nxt[None, :], mask=mask, other=0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
            w = w_next
        y = (tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=row_mask, other=0.0))[None, :]
    else:  # x's rows in tiles of BLOCK_M against each weight tile in x's dtype on the tensor cores
        wait_for_previous_kernel(PDL)
        if SWAP:  # the sums as [BLOCK_N, BLOCK_M]: the converted weights are the MMA's first operand (see launch_shape)
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k_mask = k0 + cols < K
            x = tl.load(x_rows[:, None] + k0 + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows[:, None] + k0 + cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0)
            acc = _tile_products(acc, x, w, SWAP, IEEE, INTERPRETED)
        if SWAP:
            acc = tl.trans(acc)
        y = acc * tl.load(s_ptr + rows, mask=row_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    # rounded to x's dtype: a linear's output, or the logits in float32 holding it (as the 16-bit head's)
    y = y.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m[:, None].to(tl.int64) * out_stride + rows[None, :], y,
             mask=m_mask[:, None] & row_mask[None, :])


def launch_shape(m: int, layer: bool) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, STAGES, SWAP) for a step of m rows through an LM head or (`layer`) a
    decoder linear: one row, and under kernels.row_invariant each row of a step of up to 16 (settings.invariant_step),
    on the one-row code (a row's outputs then do not depend on the step's other rows: a verify row gets a decode row's
    bits); up to 16 rows on the tensor cores as x·wᵀ; more as w·xᵀ, all the step's rows (up to MANY_ROWS_SHAPE's) in one
    tile, so each weight is converted once: sm90, 256 rows: 210 registers, no spills, 64x256x16 wgmmas reading the
    weights from registers. A layer: LAYER_SHAPES, x·wᵀ up to LAYER_ROWS rows."""
    one, few, many = INTERPRETED_SHAPES if _INTERPRETED else (ONE_ROW_SHAPE, FEW_ROWS_SHAPE, MANY_ROWS_SHAPE)
    if layer:
        one, few, layer_many = INTERPRETED_LAYER_SHAPES if _INTERPRETED else LAYER_SHAPES
    if m == 1 or settings.invariant_step(m):
        return (*one, False)
    if m <= 16:
        return (*few, False)
    if layer and m <= (INTERPRETED_LAYER_ROWS if _INTERPRETED else LAYER_ROWS):
        return (*layer_many, False)
    return (min(many[0], max(16, triton.next_power_of_2(m))), *many[1:], True)


def words_fit(weight: torch.Tensor) -> bool:
    """Can the one-row path read the weight's rows as 32-bit words: K a multiple of 4, each row 4-byte aligned?"""
    return weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0


def logits(x: torch.Tensor, w: Int8Rows) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32) against the int8 head → float32 logits [M, N] (x's dtype's values)."""
    return _product(x, w, None, torch.float32, False)


def linear(x: torch.Tensor, w: Int8Rows, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] through int8 weight rows (+ bias [N]) → [M, N] in x's dtype (model.quantization=int8's layers)."""
    return _product(x, w, bias, x.dtype, True)


def _product(x: torch.Tensor, w: Int8Rows, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
             layer: bool) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != w.weight.shape[1]:
        raise ValueError(f"int8 rows: x [M, {w.weight.shape[1]}], got {tuple(x.shape)}")
    if w.weight.dtype != torch.int8 or w.scale.shape != (w.weight.shape[0],) or w.scale.dtype != torch.float32:
        raise ValueError(f"int8 rows: int8 rows and a float32 scale a row, got {w.weight.dtype} "
                         f"{tuple(w.weight.shape)} and {w.scale.dtype} {tuple(w.scale.shape)}")
    if w.weight.device != x.device or w.scale.device != x.device:
        raise ValueError(f"int8 rows: x on {x.device}, the rows on {w.weight.device}, their scales on {w.scale.device}")
    if bias is not None and bias.shape != (w.weight.shape[0],):
        raise ValueError(f"int8 rows: a bias of {w.weight.shape[0]}, got {tuple(bias.shape)}")
    x = x.contiguous()
    weight = w.weight if w.weight.stride(-1) == 1 else w.weight.contiguous()
    scale = w.scale.contiguous()  # read at s_ptr + row
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps, stages, swap = launch_shape(m, layer)
    use_pdl = pdl.enabled(x, "gemv")
    _rows_kernel[(triton.cdiv(n, block_n) * triton.cdiv(m, block_m),)](
        x, weight, scale, scale if bias is None else bias.contiguous(), out, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), PDL=pdl.flavor(use_pdl, "gemv"), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, IEEE=x.dtype == torch.float32, WORDS=words_fit(weight), INTERPRETED=_INTERPRETED, SWAP=swap,
        HAS_BIAS=bias is not None, num_warps=warps, launch_pdl=use_pdl)
    return out
