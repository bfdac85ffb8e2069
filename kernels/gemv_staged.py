"""The one-row GEMV with its weight tiles staged in shared memory by the Tensor Memory Accelerator.

kernels/gemv.py's kernel holds the tile in flight in registers, one tile ahead: registers cap the
bytes a streaming SM has requested (~40–64 KB an SM at its launch shapes, sm90 builds), about what
Little's law asks of HBM at full rate, so the GEMVs stream at ~86% of a plain read. Here each program
keeps STAGES - 1 tiles in flight through TMA copies into shared memory (Triton's loop pipeliner
with `tl.range(num_stages=)`), and registers hold only the tile being summed and the accumulator.

Under programmatic dependent launch the pipeliner's prologue, the first STAGES - 1 weight tiles, is
issued before the wait (weights are constants), and x, which the previous kernel writes, is loaded
one tile ahead by inline asm that waits for the previous kernel itself: the pipeliner hoists a
tl.load (volatile or not) into its prologue, and the scheduler moved a load past a separate wait.
Same arithmetic as gemv.py: a float32 tile accumulator summed at the end, gate and up rows side by
side when gated, SiLU·up as the epilogue.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents
from triton.tools.tensor_descriptor import TensorDescriptor

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _x_load_asm(bits: int, pdl: bool) -> str:
    """The PTX of one x element's load, predicated on its mask; under PDL it waits for the previous
    kernel in the same block, so no scheduling can put the load before the wait (a separate gdc_wait
    was not enough: the first tile's load went ahead of it)."""
    reg = f"b{bits}"
    wait = "griddepcontrol.wait; " if pdl else ""
    return f"{{ .reg .pred p; {wait}setp.ne.b32 p, $2, 0; mov.{reg} $0, 0; @p ld.global.{reg} $0, [$1]; }}"


@triton.jit
def _load_x(ptrs, mask, X_ASM: tl.constexpr, INTERPRETED: tl.constexpr):
    """x's tile, loaded where the loop pipeliner leaves it (inline asm: the pipeliner hoists a
    tl.load, volatile or not, into its prologue, ahead of the PDL wait)."""
    if INTERPRETED:
        return tl.load(ptrs, mask=mask, other=0.0)
    if ptrs.dtype.element_ty.primitive_bitwidth == 16:
        bits = tl.inline_asm_elementwise(X_ASM, "=h,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int16, is_pure=False,
                                         pack=1)
    else:
        bits = tl.inline_asm_elementwise(X_ASM, "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
                                         pack=1)
    return bits.to(ptrs.dtype.element_ty, bitcast=True)


@triton.jit
def _gemv_staged_kernel(x_ptr, w_desc, b_ptr, out_ptr, N, K, up_row, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                        PDL: tl.constexpr, X_ASM: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    if PDL == 1:  # EARLY (kernels/pdl.py): the next kernel may launch from now on
        gdc_launch_dependents()
    row0 = tl.program_id(0) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    x_next = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        # past the weight's rows or K the copy gives zeros (a gate tile past N reads up rows: not stored)
        w = w_desc.load([row0, k0])
        if GATED:
            up = w_desc.load([up_row + row0, k0])
        # x one tile ahead, so no iteration but the first waits for its load (an L2 round trip)
        if k0 == 0:
            x = _load_x(x_ptr + cols, cols < K, X_ASM, INTERPRETED).to(tl.float32)
            if PDL == 2:  # LATE (kernels/pdl.py): the next kernel may launch once this one's wait returned
                gdc_launch_dependents()
        else:
            x = x_next
        x_next = _load_x(x_ptr + k0 + BLOCK_K + cols, k0 + BLOCK_K + cols < K, X_ASM, INTERPRETED).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            up_acc += up.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        # Round as the unfused path does: linear output to the dtype, silu(gate) to the dtype.
        gate = y.to(dtype).to(tl.float32)
        up_y = tl.sum(up_acc, axis=1).to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        y = act * up_y
    # a float32 output (the LM head's logits) still holds the input dtype's rounding, as cuBLAS + .float()
    tl.store(out_ptr + rows, y.to(x_ptr.dtype.element_ty).to(dtype), mask=row_mask)


def tma_ready(weight: torch.Tensor) -> bool:
    """Can a TMA descriptor address this weight: unit column stride, 16-byte aligned base and rows."""
    size = weight.element_size()
    return (weight.dim() == 2 and weight.stride(1) == 1 and weight.data_ptr() % 16 == 0
            and (weight.stride(0) * size) % 16 == 0 and weight.shape[1] * size >= 16)


def gemv_staged(x: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor, n: int, gated: bool,
                pdl_flavor: int, block_n: int, block_k: int, warps: int, stages: int) -> None:
    """out [1, n] = x [1, K] · weightᵀ (+ bias), or SiLU-gated over weight = gate‖up; checked by gemv().
    pdl_flavor: pdl.flavor()'s value, 0 for a launch without PDL."""
    k = weight.shape[1]
    desc = TensorDescriptor(weight, shape=list(weight.shape), strides=[weight.stride(0), 1],
                            block_shape=[block_n, block_k])
    _gemv_staged_kernel[(triton.cdiv(n, block_n),)](
        x, desc, bias if bias is not None else x, out, n, k, n, HAS_BIAS=bias is not None, GATED=gated,
        PDL=pdl_flavor, X_ASM=_x_load_asm(8 * x.element_size(), bool(pdl_flavor)), INTERPRETED=_INTERPRETED,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        num_warps=warps, launch_pdl=bool(pdl_flavor))
