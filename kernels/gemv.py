"""One-row linear layer (y = x Wᵀ + b) for batch-1 decode, where every step reads all the weights
once and the speed is the weight-read bandwidth.

cuBLAS picks split-K plus a separate reduce kernel for the narrow outputs (o_proj, down_proj) and
reaches 2.8–3.8 TB/s on them; here each program owns BLOCK_N whole output rows and walks all of K,
so there is no reduce and no second kernel (but for an e4m3 layer's launch shape with a SPLIT: there
a tile's last program adds the others' partial sums, kernels/split_k.py). `gated=True` reads the gate
and up rows of a fused gate‖up weight side by side and writes silu(gate) * up: the MLP's SiLU kernel
and the round trip of its 2I-wide input disappear. A launch shape with STAGES ≥ 2 runs the TMA-staged kernel instead
(gemv_staged.py), which only the vocabulary-sized LM head takes by default.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from llaunch.kernels import fp8, gemv_fp8, gemv_staged, pdl, settings, skinny_gemm
from llaunch.kernels.fp8 import Fp8Weight
from llaunch.kernels.e4m3_words import word_dots
from llaunch.kernels.row_dots import row_dots
from llaunch.kernels.split_k import added_shares, counters

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Under the interpreter (a Python loop per program) few, large programs keep tests fast; the tests
# set STAGES here to run the staged kernel too.
INTERPRETED_SHAPE = (32, 256, 4, 0)
ACT_MODES = {fp8.NONE: 0, fp8.DYNAMIC: 1, fp8.STATIC: 2}  # an fp8 layer's activations, the kernel's ACT


# Every GEMV but the gated gate‖up one requests x's next tile with the weights' next tile (row_dots'
# X_AHEAD). On an H200 the batch-1 step took 3.630 / 3.635 ms so against 3.688 / 3.676 with x loaded
# at the top of each iteration, and 3.689 / 3.690 with gate_up ahead too: there it costs registers
# (79 → 93 on sm90, a program fewer an SM).


def launch_shape(n: int, k: int, gated: bool, fp8: bool = False,
                 words: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, STAGES, SPLIT) for a shape (of e4m3 weights where fp8; `words`: the register
    kernel would read them as words, kernels.fp8_words). SPLIT: K over that
    many programs a tile (an ungated e4m3 layer on the tensor-core kernel or the register one reading words; 1
    elsewhere). STAGES 0: the register
    kernel here (for the LM head, called through dispatch.lm_head_linear: cuBLAS); ≥ 2: the TMA-staged
    kernel (gemv_staged.py) with that pipeline depth, for e4m3 weights the tensor-core kernel (gemv_fp8.py).
    Fixed, not autotuned: the block sizes set the summation order, and a timing-dependent pick could make
    greedy output differ between restarts and between replicas. Picked on an H200 by a sweep of Qwen2-7B's
    layers chained as in a decode step (13 GB of distinct weights, with PDL; scripts/bench_gemv_chain.py, removed after 6275284):
    tiles of 1k columns (256 for the gated gate‖up, whose programs read two rows per output) × 4 warps,
    more rows per program where outputs are fewer than inputs."""
    if _INTERPRETED:
        return (*INTERPRETED_SHAPE, 1)
    overrides = settings.current.gemv_shapes
    if (n, k, gated, fp8) in overrides:
        return overrides[(n, k, gated, fp8)]
    if fp8:
        return _fp8_launch_shape(n, k, gated, words)
    if n >= 65536:  # an LM head: the staged kernel (run 4: 0.237 ms for Qwen2-7B's, cuBLAS 0.248)
        return 16, 256, 4, 4, 1
    return (*_register_shape(n, k, gated), 1)


def _fp8_launch_shape(n: int, k: int, gated: bool, words: bool) -> tuple[int, int, int, int, int]:
    """e4m3 weights: a tile holds half the bytes of a bf16 one and every weight is converted before its FMA,
    so programs take more rows. An H200 sweep of Qwen2-7B's decode step (scripts/bench_decode_shapes.py
    --fp8, each layer kind's shape varied alone, the step in its CUDA graph) took 3.41 ms with these
    against 4.37 with bf16's (qkv 8/512/4, o_proj 16/512/8, down_proj 16/512/8), and 3.16 with the gated
    gate‖up on the tensor cores (32/256/4, 3 stages; the register kernel's best 16/256/4: 3.35), 2.80 with
    down_proj there too, K split over 8 programs a tile (64/256/4, 3 stages; 2.92 at 32/256/4/4/8, 2.99 at
    16 splits, 3.33-4.44 at 2-4 splits: too few programs for 132 SMs). The tensor cores lost on the square
    and wide ones (o_proj 3.19-3.30 ms, qkv 3.18-3.38 with 1-8 splits). Read as words (kernels.fp8_words,
    later), down_proj went back to the register kernel at 32/1024/8: served batch-1 Qwen2-7B on an H100 305 tok/s
    against 288 on the tensor cores (2026-12-05, `gpu_calls.sh fp8single`; not yet measured on an H200), and so did
    the gated gate‖up at 8/512/4 (94 sm90 registers, 5 programs an SM): the H100's step 3.222 ms against 3.316 on
    the tensor cores, 4/512/4 3.323, 8/256/4, 16/256/4, 16/512/8, 8/512/8, 4/1024/4 and 8/1024/8 3.34-3.51
    (2026-12-07, bench_decode_shapes --fp8); served with the sweep's down_proj 16/1024/8 and o_proj 8/512/4 too (each
    within 0.3% of built in) 308.3 tok/s against 297.7 (not yet measured on an H200)."""
    if gated:
        return (8, 512, 4, 0, 1) if words else (32, 256, 4, 3, 1)
    if n >= 65536:  # an e4m3 LM head (model.fp8_lm_head): Qwen2-7B's step 2.678 ms against 2.787 at 8/512/4
        return 64, 256, 4, 3, 1  # (H200, fe41bbd, bench_decode_shapes --fp8 --fp8-lm-head; 32/256/4/3 2.692)
    if k > 2 * n:  # a down_proj: few output tiles over a long K (32/1024/8 as words: 210 sm90 registers, one
        # program an SM, Qwen2-7B's 112 on 132 SMs; gpu_calls.sh fp8tune sweeps shapes of 2-12 an SM)
        return (32, 1024, 8, 0, 1) if words else (64, 256, 4, 3, 8)
    return (*_fp8_register_shape(n, k, gated), 1)


def _fp8_register_shape(n: int, k: int, gated: bool) -> tuple[int, int, int, int]:
    """e4m3 weights through the register kernel: the built-in shapes above, and for a gated gate‖up that
    the tensor cores do not take (weight-only layers, GPUs before Hopper) bf16's 8/256/4 (sm90 builds: 118
    registers; 16/256/4 and the tensor cores' 32/256/4 spill to the stack there)."""
    if gated:
        return 8, 256, 4, 0
    if k >= 2048:
        return (8, 512, 4, 0) if n > k else (16, 512, 8, 0)
    return 2, max(64, triton.next_power_of_2(k)), 4, 0


# The most columns of x one load of the dynamic scale's absmax takes (e4m3.row_scale). On the H200 the fp8
# decode step took 3.343 / 3.347 / 3.344 ms at 1024 / 4096 / 8192: the loop's round trips are not its cost.
AMAX_TILE = 4096


def amax_block(k: int) -> int:
    """Columns a load in an fp8 GEMV's absmax of x: all of K up to AMAX_TILE, fewer under the interpreter."""
    return min(triton.next_power_of_2(k), 256 if _INTERPRETED else AMAX_TILE)


def swap_ab(weight: torch.Tensor, n: int, k: int, gated: bool, block_n: int, block_k: int) -> bool:
    """Does an e4m3 layer's tensor-core GEMV take its weight tiles by TMA as the MMA's A operand: its shape named in
    kernels.fp8_swap_ab, tiles a TMA box holds and a weight a descriptor can address."""
    return ((n, k, gated) in settings.current.fp8_swap_ab and max(block_n, block_k) <= settings.MAX_TMA_BOX
            and gemv_staged.tma_ready(weight))


def staged_for(weight: torch.Tensor) -> bool:
    """Does a one-row product with this weight run the staged kernel: a launch shape with STAGES ≥ 2
    (the built-in one for an LM head, or kernels.gemv_shapes), a weight TMA can address, and a GPU
    it was measured on (Hopper; before it Triton lowers the descriptors to plain loads)? What
    dispatch.lm_head_linear asks before it leaves cuBLAS."""
    return (launch_shape(*weight.shape, False)[3] >= 2 and gemv_staged.tma_ready(weight)
            and pdl.hopper_or_later(weight.device.index or 0))


@triton.jit(do_not_specialize=["m_rows"])
def _gemv_kernel(x_ptr, w_ptr, s_ptr, xs_ptr, b_ptr, out_ptr, part_ptr, count_ptr, N, K, w_stride, up_offset, scale_ub,
                 x_stride, out_stride, m_rows, HAS_SCALE: tl.constexpr, ACT: tl.constexpr, HAS_UB: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, X_AHEAD: tl.constexpr, AMAX_BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
                 WORDS: tl.constexpr = False, ROW_GRID: tl.constexpr = False, SPLIT: tl.constexpr = 1):
    # ROW_GRID (kernels.row_invariant): a program per row of x (m_rows of them, not specialized on: one compiled code
    # for every row count) and tile of outputs, a tile's rows side by side (its weights read once from memory, the
    # other rows' reads from L2). Else one row, a program a tile. SPLIT > 1 (WORDS, ungated, one row): K over SPLIT
    # programs a tile (program_id(1)), their float32 partials added in split order by the tile's last (split_k).
    if ROW_GRID:
        pid = tl.program_id(0)
        tile = pid // m_rows
        x_row = (pid % m_rows).to(tl.int64)
        x_ptr += x_row * x_stride
        out_ptr += x_row * out_stride
    else:
        tile = tl.program_id(0)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    x_scale = 1.0
    if ACT == 2:  # a static activation scale
        x_scale = tl.load(xs_ptr)
    # ACT 1, an fp8 layer's dynamic activation scale: row_dots takes x's absmax after the PDL wait
    if WORDS:  # e4m3 weights 4 a word, their products in float16 pairs (kernels/e4m3_words.py)
        w_words = (w_ptr + rows.to(tl.int64) * w_stride).to(tl.pointer_type(tl.int32), bitcast=True)
        y, up_y, x_scale = word_dots(x_ptr, w_words, row_mask, K, up_offset // 4, GATED, PDL, BLOCK_N, BLOCK_K,
                                     x_scale, ACT == 1, scale_ub, HAS_UB, AMAX_BLOCK, INTERPRETED, SPLIT=SPLIT)
    else:
        y, up_y, x_scale = row_dots(x_ptr, w_ptr + rows.to(tl.int64) * w_stride, row_mask, K, up_offset, GATED,
                                    PDL, BLOCK_N, BLOCK_K, X_AHEAD, x_scale, ACT != 0, INTERPRETED, ACT == 1, scale_ub,
                                    HAS_UB, AMAX_BLOCK)
    last = True
    if SPLIT > 1:
        y, last = added_shares(y, part_ptr + rows, N, row_mask, count_ptr, tile, SPLIT)
    if last:
        _store_rows(y, up_y, x_scale, x_ptr, s_ptr, b_ptr, out_ptr, rows, row_mask, N, HAS_SCALE, HAS_BIAS, GATED)


@triton.jit
def _store_rows(y, up_y, x_scale, x_ptr, s_ptr, b_ptr, out_ptr, rows, row_mask, N, HAS_SCALE: tl.constexpr,
                HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """A tile's float32 sums → out: an fp8 layer's scales, the bias, gated: silu(gate) · up."""
    if HAS_SCALE:  # e4m3 weights: each output channel's float32 scale (and the row's) on the float32 sum
        y *= tl.load(s_ptr + rows, mask=row_mask, other=0.0) * x_scale
        if GATED:
            up_y *= tl.load(s_ptr + N + rows, mask=row_mask, other=0.0) * x_scale
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        # Round as the unfused path does: linear output to the dtype, silu(gate) to the dtype.
        gate = y.to(dtype).to(tl.float32)
        up_y = up_y.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * up_y
    # a float32 output (the LM head's logits) still holds the input dtype's rounding, as cuBLAS + .float()
    tl.store(out_ptr + rows, y.to(x_ptr.dtype.element_ty).to(dtype), mask=row_mask)


def gemv(x: torch.Tensor, weight: Union[torch.Tensor, Fp8Weight], bias: Optional[torch.Tensor] = None, *,
         gated: bool = False, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]ᵀ (+ bias [N]) → [1, N]; gated: weight is gate‖up [2I, K] and the
    result silu(x gateᵀ) * (x upᵀ), [1, I]. Under kernels.row_invariant a 16-bit layer takes x of 1 to
    16 rows (settings.INVARIANT_ROWS), each row by its own programs running the code one row runs (the row grid: a row's
    outputs are the same bits in a step of any size). `out_dtype` float32 stores the x-dtype result widened
    (the LM head's logits without a cast kernel after it). An fp8 layer (per-channel e4m3 weights): x is
    quantized as its activation mode says (dynamic: by the row's absmax; static; none) as it is read, and
    each float32 sum multiplied by the row's and the channel's scales (kernels/fp8.reference_linear's roundings
    up to the order of the sum)."""
    layer = weight if isinstance(weight, Fp8Weight) else None
    row_grid = layer is None and settings.current.row_invariant
    if x.dim() != 2 or not (x.shape[0] == 1 or row_grid and settings.invariant_step(x.shape[0])):
        raise ValueError(f"gemv takes one row (up to {settings.INVARIANT_ROWS} of a 16-bit layer under "
                         f"kernels.row_invariant), got x of shape {tuple(x.shape)}")
    if layer is not None:
        if layer.block is not None:
            raise ValueError(f"gemv: an fp8 layer with per-channel scales, got blocks of {layer.block}")
        weight = layer.weight
        if weight.dtype != torch.float8_e4m3fn or layer.scale.shape != (weight.shape[0],):
            raise ValueError(f"gemv: an fp8 layer needs e4m3 weights and [N] scales, got {weight.dtype} "
                             f"{tuple(weight.shape)} and {tuple(layer.scale.shape)}")
    elif weight.dtype != x.dtype:
        raise ValueError(f"gemv: x is {x.dtype}, weight {weight.dtype}")
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"gemv: x is {x.dtype}, weight {weight.dtype}, bias {None if bias is None else bias.dtype}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gemv: a gated weight stacks gate and up, so it needs an even row count, got {weight.shape[0]}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x has {x.shape[1]} columns, weight {weight.shape[1]}")
    copied = weight.stride(-1) != 1
    if copied:
        weight = weight.contiguous()
    x = x.contiguous()
    bias = bias.contiguous() if bias is not None else None
    n_total, k = weight.shape
    n = n_total // 2 if gated else n_total
    if out_dtype not in (None, x.dtype, torch.float32) or (gated and out_dtype not in (None, x.dtype)):
        raise ValueError(f"gemv: out_dtype {out_dtype} for {x.dtype} input (float32 or the input's, ungated)")
    if (layer is None and not row_grid and out_dtype in (None, x.dtype) and x.dtype in (torch.bfloat16, torch.float16)
            and (n, k, gated) in settings.current.skinny_one_row):
        return skinny_gemm.skinny_gemm(x, weight, bias, gated=gated)  # kernels.skinny_one_row: the tensor cores
    m = x.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if n == 0:
        return out
    act = ACT_MODES[layer.activations] if layer is not None else 0
    words = layer is not None and words_for(x, weight, act)
    block_n, block_k, warps, stages, split = launch_shape(n, k, gated, layer is not None, words)
    if row_grid and not _INTERPRETED and (n, k, gated, False) not in settings.current.gemv_shapes:
        block_n, block_k, warps, stages = _row_grid_shape(n, k, gated)
    elif row_grid and stages >= 2:  # the register kernel for every row count (the staged one has no row grid)
        block_n, block_k, warps, stages = (*INTERPRETED_SHAPE[:3], 0) if _INTERPRETED else _register_shape(n, k, gated)
    # Under PDL the first weight tiles are read before the wait: only a weight no earlier kernel wrote.
    use_pdl = pdl.enabled(x, "gemv") and not copied
    if stages >= 2 and layer is None and gemv_staged.tma_ready(weight):
        gemv_staged.gemv_staged(x, weight, bias, out, n, gated, pdl.flavor(use_pdl, "gemv"), block_n, block_k,
                                warps, stages)
        return out
    if stages >= 2 and layer is not None:
        # the tensor-core kernel where STAGES >= 2 says so, x is quantized, the tile's K fits an fp8 MMA
        # (32) and the GPU is one it was measured on; else the register kernel with its own shape
        hopper = _INTERPRETED or pdl.hopper_or_later(x.device.index or 0)
        if act != ACT_MODES[fp8.NONE] and block_k >= 32 and hopper:
            gemv_fp8.gemv_fp8(x, weight, layer.scale, layer.input_scale, layer.scale_ub, bias, out, n, gated,
                              act == ACT_MODES[fp8.DYNAMIC], pdl.flavor(use_pdl, "gemv"), block_n, block_k, warps,
                              stages, amax_block(k), 1 if gated else split, swap_ab(weight, n, k, gated, block_n, block_k))
            return out
        block_n, block_k, warps, stages = INTERPRETED_SHAPE if _INTERPRETED else _fp8_register_shape(n, k, gated)
        split = 1  # (the tensor-core shape's split is not the register kernel's)
    # K split over programs: the register kernel where it reads e4m3 words (an ungated one-row layer), else 1
    split = split if words and not gated and not row_grid else 1
    tiles = triton.cdiv(n, block_n)
    parts = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else out
    counts = counters(x.device, tiles) if split > 1 else out
    _gemv_kernel[(tiles * (m if row_grid else 1), split)](
        x, weight, layer.scale if layer is not None else x,
        layer.input_scale if act == ACT_MODES[fp8.STATIC] else x, bias if bias is not None else x, out, parts, counts,
        n, k,
        weight.stride(0), n * weight.stride(0), (layer.scale_ub or 0.0) if layer is not None else 0.0,
        x.stride(0), out.stride(0), m,
        HAS_SCALE=layer is not None, ACT=act, HAS_UB=layer is not None and layer.scale_ub is not None,
        HAS_BIAS=bias is not None, GATED=gated, PDL=pdl.flavor(use_pdl, "gemv"), BLOCK_N=block_n, BLOCK_K=block_k,
        X_AHEAD=not gated, AMAX_BLOCK=amax_block(k), INTERPRETED=_INTERPRETED,
        WORDS=words, ROW_GRID=row_grid, SPLIT=split, num_warps=warps, launch_pdl=use_pdl)
    return out


def _register_shape(n: int, k: int, gated: bool) -> tuple[int, int, int, int]:
    """A 16-bit layer's register-kernel shape (an LM head's too, where the staged kernel does not run it)."""
    if gated:
        return 8, 256, 4, 0
    if k >= 2048:
        return (2, 1024, 4, 0) if n > k else (4, 1024, 4, 0)
    return 2, max(64, triton.next_power_of_2(k)), 4, 0


def _row_grid_shape(n: int, k: int, gated: bool) -> tuple[int, int, int, int]:
    """A 16-bit layer's shape on the row grid (kernels.row_invariant): the register kernel's, but an LM head's (a
    vocabulary of 32k+ outputs) over a K of up to 1,024 at 8 rows x 256 columns a program. The grid multiplies the
    programs by the step's rows, and the built-in 2 x 1,024 gives SmolLM2's head 24,576 programs a row over a K of
    576 (44% of each tile masked). SmolLM2's decode / verify k = 1-4 steps on an H100 (0eafbd5, `gpu_calls.sh
    spectune`, dummy weights): 0.322 / 0.363 / 0.423 / 0.452 / 0.538 ms against 0.330 / 0.391 / 0.467 / 0.517 /
    0.623 built in (16 x 256 the same, 4 x 256 and 8 x 512 between them); no other layer kind's shape gained alone.
    Heads of a K past 1,024 (Qwen2-7B's 3,584) keep the register shape: not measured."""
    if not gated and n >= 32768 and k <= 1024:
        return 8, 256, 4, 0
    return _register_shape(n, k, gated)


def words_for(x: torch.Tensor, weight: torch.Tensor, act: int) -> bool:
    """Does an e4m3 layer's register kernel read its weights as words (kernels.fp8_words): x quantized, a bfloat16
    model and rows of whole, aligned words. (Their float16 sums move ~half the outputs by a float16 step, none
    past bfloat16's rounding: a float16 or float32 model keeps float32 products.)"""
    return (settings.current.fp8_words and weight.dtype == torch.float8_e4m3fn and act != ACT_MODES[fp8.NONE]
            and x.dtype == torch.bfloat16 and weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0
            and weight.data_ptr() % 4 == 0)
