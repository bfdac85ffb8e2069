"""One-row linear layer (y = x Wᵀ + b) for batch-1 decode, where every step reads all the weights
once and the speed is the weight-read bandwidth.

cuBLAS picks split-K plus a separate reduce kernel for the narrow outputs (o_proj, down_proj) and
reaches 2.8–3.8 TB/s on them; here each program owns BLOCK_N whole output rows and walks all of K,
so there is no reduce and no second kernel. `gated=True` reads the gate and up rows of a fused
gate‖up weight side by side and writes silu(gate) * up: the MLP's SiLU kernel and the round trip of
its 2I-wide input disappear.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llaunch.kernels import pdl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def launch_shape(n: int, k: int, gated: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, programs per SM; 0: one program per row block) for a shape.
    Fixed, not autotuned: the block sizes set the summation order, and a timing-dependent pick could
    make greedy output differ between restarts and between replicas. Picked on an H200 by
    `scripts/bench_gemv_chain.py --sweep` (Qwen2-7B's layers chained as in a decode step, with PDL;
    docs/benchmarks.md)."""
    if _INTERPRETED:  # a Python loop per program: few, large programs keep tests fast
        return 32, 256, 4, 0
    if gated:
        return 4, 512, 4, 0
    if k >= 2048:
        return (4, 1024, 4, 0) if k >= 8192 else (2, 1024, 4, 0)
    return 2, max(64, triton.next_power_of_2(k)), 4, 0


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, w_stride, up_offset,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Program p owns row blocks p, p + P, p + 2P, … (P programs) and walks their tiles in one flat
    loop, so a grid smaller than the row-block count keeps every program busy to the end."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, n_programs) * k_tiles
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    # Software pipelining by one tile: tile i+1's loads are in flight while tile i is summed. The
    # first tile is requested before the PDL wait: weights are constants, x is the previous kernel's.
    rows = pid * BLOCK_N + offs_n
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w_tile = w_ptr + rows.to(tl.int64)[:, None] * w_stride + cols[None, :]
    w = tl.load(w_tile, mask=mask, other=0.0, eviction_policy="evict_first")
    up = w
    if GATED:
        up = tl.load(w_tile + up_offset, mask=mask, other=0.0, eviction_policy="evict_first")
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(n_tiles):
        k0 = (i % k_tiles) * BLOCK_K
        rows = (pid + (i // k_tiles) * n_programs) * BLOCK_N + offs_n
        x = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        nk0 = ((i + 1) % k_tiles) * BLOCK_K
        n_rows = (pid + ((i + 1) // k_tiles) * n_programs) * BLOCK_N + offs_n
        row_limit = tl.where(i + 1 < n_tiles, N, 0)  # no next tile after the last: nothing loaded
        mask = (n_rows < row_limit)[:, None] & (nk0 + cols < K)[None, :]
        w_tile = w_ptr + n_rows.to(tl.int64)[:, None] * w_stride + nk0 + cols[None, :]
        w_next = tl.load(w_tile, mask=mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
        if GATED:
            up_next = tl.load(w_tile + up_offset, mask=mask, other=0.0, eviction_policy="evict_first")
            up_acc += up.to(tl.float32) * x[None, :]
            up = up_next
        if k0 + BLOCK_K >= K:  # the row block's last tile: its outputs are complete
            row_mask = rows < N
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
            tl.store(out_ptr + rows, y.to(dtype), mask=row_mask)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         gated: bool = False) -> torch.Tensor:
    """x [1, K] @ weight [N, K]ᵀ (+ bias [N]) → [1, N]; gated: weight is gate‖up [2I, K] and the
    result silu(x gateᵀ) * (x upᵀ), [1, I]."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"gemv: x is {x.dtype}, weight {weight.dtype}, bias {None if bias is None else bias.dtype}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gemv: a gated weight stacks gate and up, so it needs an even row count, got {weight.shape[0]}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    x = x.contiguous()
    bias = bias.contiguous() if bias is not None else None
    n_total, k = weight.shape
    n = n_total // 2 if gated else n_total
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_n, block_k, warps, per_sm = launch_shape(n, k, gated)
    programs = triton.cdiv(n, block_n)
    if per_sm:  # persistent: a fixed number of programs, each looping over its row blocks
        programs = min(programs, per_sm * (_sm_count(x.device.index or 0) if x.is_cuda else 1))
    use_pdl = pdl.enabled(x)
    _gemv_kernel[(programs,)](
        x, weight, bias if bias is not None else x, out, n, k, weight.stride(0), n * weight.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, PDL=use_pdl, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **pdl.launch_options(use_pdl))
    return out
