"""The mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE and Mixtral, fused as vLLM's fused_moe.

`moe_route`: one program per token: the float32 softmax of its router logits, the top-k by repeated argmax
(the lower expert on a tie), renormalized to sum to 1 where the model says so.

`fused_moe`: every (token, k) pair goes to its expert. The pairs are sorted by expert and each expert's run is
padded to BLOCK_M (`align`: three small kernels without a host sync, so decode graphs capture it); then two grouped GEMMs,
each program one BLOCK_M run of a single expert: gate‖up with the SiLU-and-multiply in its epilogue ([pairs, I]),
and down with the routing weight in its epilogue ([pairs, H]); a token's k rows are summed back in token order.
A step of few pairs (a launch with BLOCK_M 1: by default at most 16 pairs, batch-1 and batch-2 decode of a top-8
model) runs each pair's gate‖up as a GEMV instead (row_dots, as the dense batch-1 GEMV), and each token's down
products as one GEMV over its k experts, weighted and summed in its epilogue (no [pairs, H] rows, no reduce):
nothing to sort or pad, and the weights streamed at the GEMV's bandwidth where 16-row tiles of one valid row read
them at ~1.7 TB/s (H200, T=1). Routing and these two kernels launch with PDL in the decode graphs.
Pairs whose expert another rank holds (parallel.ep) are computed nowhere here: their rows stay zero.

The roundings are the reference's (kernels/reference.py fused_moe): gate and up, silu(gate), the product, the
down product and the weighted row each rounded to the model's dtype. Launch shapes: kernels.moe_shapes per layer
shape (kernels/settings.py), else those measured on the GPU model (kernels/moe_launches.py), else `default_launch`.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import pdl, settings
from llaunch.kernels.moe_launches import MOE_SHAPES_BY_DEVICE
from llaunch.kernels.pdl_wait import wait_for_previous_kernel
from llaunch.kernels.row_dots import row_dots
from llaunch.kernels.settings import MoeLaunch, MoeShapes, parse_moe_shapes

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    wait_for_previous_kernel(PDL)  # the logits are the router GEMV's
    x = tl.load(logits_ptr + row * stride_l + experts, mask=experts < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(experts < E, p, -1.0)  # never chosen
    slots = tl.arange(0, BLOCK_TOP)
    weights = tl.zeros((BLOCK_TOP,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_TOP,), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        chosen = tl.min(tl.where(p == best, experts, BLOCK_E), axis=0)
        weights = tl.where(slots == k, best, weights)
        ids = tl.where(slots == k, chosen, ids)
        p = tl.where(experts == chosen, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits → (weights [T, k] float32, experts [T, k] int32), descending weights."""
    tokens, experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if tokens:
        use_pdl = pdl.enabled(router_logits, "moe")
        _route_kernel[(tokens,)](router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
                                 RENORMALIZE=renormalize, PDL=pdl.flavor(use_pdl, "moe"),
                                 BLOCK_E=triton.next_power_of_2(experts), BLOCK_TOP=triton.next_power_of_2(top_k),
                                 num_warps=1 if experts <= 128 else 4, launch_pdl=use_pdl)
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, pairs, expert_start, num_local, BLOCK: tl.constexpr):
    """counts[e] += the pairs of this block routed to local expert e (atomics: counts starts at zero)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1).to(tl.int32) - expert_start
    mine = (offs < pairs) & (local >= 0) & (local < num_local)
    tl.atomic_add(counts_ptr + local, 1, mask=mine)


@triton.jit
def _runs_kernel(counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, padded_ptr, pairs, num_local, max_blocks,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr):
    """One program: each expert's run padded to BLOCK_M, where runs start (the cursors the placing kernel advances),
    the expert of every row tile, the used length; every slot set to the padding value `pairs` first."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_local, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + experts, ends - padded, mask=experts < num_local)
    tl.store(padded_ptr, tl.sum(padded, axis=0).to(tl.int64))
    ends = tl.where(experts < num_local, ends, 2147483647)
    for first in range(0, max_blocks, BLOCK):
        blocks = first + tl.arange(0, BLOCK)
        # searchsorted(ends, block start, right): how many runs end at or before the tile's first row
        owner = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.minimum(owner, num_local - 1), mask=blocks < max_blocks)
    for first in range(0, max_blocks * BLOCK_M + 1, FILL):
        slots = first + tl.arange(0, FILL)
        tl.store(sorted_ptr + slots, tl.zeros((FILL,), tl.int32) + pairs, mask=slots < max_blocks * BLOCK_M + 1)


@triton.jit
def _place_kernel(ids_ptr, cursor_ptr, sorted_ptr, pairs, expert_start, num_local, BLOCK: tl.constexpr):
    """Each local pair takes the next slot of its expert's run (the order within a run is the atomics': a row's
    result does not depend on its place in the tile)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1).to(tl.int32) - expert_start
    mine = (offs < pairs) & (local >= 0) & (local < num_local)
    slot = tl.atomic_add(cursor_ptr + local, 1, mask=mine)
    tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=mine)


_ALIGN_BLOCK = 1024  # pairs per counting / placing program


def align(topk_ids: torch.Tensor, num_local: int, expert_start: int, block_m: int):
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m. → (sorted_pairs [max_blocks *
    block_m + 1] int32: pair index t * k + j, or the pair count in padding; block_expert [max_blocks] int32: the
    local expert of each run of block_m; padded [1] int64: the used length, blocks past it exit at once). Pairs of
    experts outside [expert_start, expert_start + num_local) are left out. Three launches and no host sync (the
    torch ops it replaced were ~35 launches a layer, most of a batch-1 decode step's MoE time)."""
    ids = topk_ids.reshape(-1)
    pairs = ids.numel()
    # at most min(pairs, experts) runs are non-empty, each wasting under block_m rows
    max_blocks = triton.cdiv(pairs + min(pairs, num_local) * (block_m - 1), block_m)
    device = ids.device
    counts = torch.zeros(2 * num_local, dtype=torch.int32, device=device)  # counts, then the runs' cursors
    sorted_pairs = torch.empty(max_blocks * block_m + 1, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    padded = torch.empty(1, dtype=torch.int64, device=device)
    grid = (triton.cdiv(pairs, _ALIGN_BLOCK),)
    if pairs:
        _count_kernel[grid](ids, counts, pairs, expert_start, num_local, BLOCK=_ALIGN_BLOCK)
    block_e = triton.next_power_of_2(num_local)
    _runs_kernel[(1,)](counts, counts[num_local:], sorted_pairs, block_expert, padded, pairs, num_local, max_blocks,
                       BLOCK_M=block_m, BLOCK_E=block_e, BLOCK=max(16, min(1024, 16384 // block_e)),
                       FILL=1024, num_warps=4)
    if pairs:
        _place_kernel[grid](ids, counts[num_local:], sorted_pairs, pairs, expert_start, num_local, BLOCK=_ALIGN_BLOCK)
    return sorted_pairs, block_expert, padded


@triton.jit
def _swizzled(pid, num_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid: GROUP_M row tiles walk one column of weight tiles together."""
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _expert_tile(pid_m, pid_n, sorted_ptr, block_expert_ptr, N, num_pairs, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Row tile pid_m's (expert, token) pairs (valid: not padding), its expert, and column tile pid_n's columns."""
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pair, pair < num_pairs, expert, offs_n, offs_n < N


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, padded_ptr, N, K, num_pairs, num_m,
                    stride_xm, stride_we, stride_wn, stride_om, TOP_K: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """out[pair, n] = silu(x[token] · gate[e, n]) * (x[token] · up[e, n]); N: the expert's intermediate columns."""
    pid_m, pid_n = _swizzled(tl.program_id(0), num_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    pair, valid, expert, offs_n, n_in = _expert_tile(pid_m, pid_n, sorted_ptr, block_expert_ptr, N, num_pairs,
                                                     BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pair // TOP_K)[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + N * stride_wn  # the up rows follow the gate rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_in = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
        if UPCAST:  # the interpreter's 16-bit dot is not a GPU's: give it float32
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    y = (act * acc_u.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], y, mask=valid[:, None] & n_in[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, padded_ptr, N, K, num_pairs, num_m,
                 stride_am, stride_we, stride_wn, stride_om, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[pair, n] = weight[pair] * (a[pair] · down[e, n]); N: hidden, K: the expert's intermediate columns."""
    pid_m, pid_n = _swizzled(tl.program_id(0), num_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    pair, valid, expert, offs_n, n_in = _expert_tile(pid_m, pid_n, sorted_ptr, block_expert_ptr, N, num_pairs,
                                                     BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pair[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_in = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    y = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], y, mask=valid[:, None] & n_in[None, :])


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, out_ptr, ids_ptr, N, K, expert_start, num_local, stride_xm, stride_we,
                         stride_wn, stride_om, TOP_K: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """One (token, expert) pair's gate‖up as a GEMV: out[pair, n] = silu(x[token] · gate[e, n]) * (x · up[e, n])."""
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    wait_for_previous_kernel(PDL)  # the expert ids are the route kernel's: nothing is read before
    expert = tl.load(ids_ptr + pair).to(tl.int64) - expert_start
    mine = (expert >= 0) & (expert < num_local)  # else another rank's (parallel.ep): no row of it here
    row_mask = rows < tl.where(mine, N, 0)
    w_rows = w_ptr + tl.where(mine, expert, 0) * stride_we + rows.to(tl.int64) * stride_wn
    g, u, _ = row_dots(x_ptr + (pair // TOP_K) * stride_xm, w_rows, row_mask, K, N * stride_wn, True, False,
                       BLOCK_N, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    gate = g.to(dtype).to(tl.float32)  # the grouped kernel's roundings
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + pair * stride_om + rows, (act * u.to(dtype).to(tl.float32)).to(dtype), mask=row_mask)


@triton.jit
def _pair_down_sum_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, N, K, expert_start, num_local, stride_am,
                          stride_we, stride_wn, stride_om, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                          PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A token's down products for all its pairs at once, weighted and summed: out[t, n] = Σ_k w_k · (a[t·TOP_K + k]
    · down[e_k, n]). Each program holds a [SLOTS, BLOCK_N, BLOCK_K] tile (SLOTS: TOP_K to a power of two), the
    next one in flight while it is summed, so a token's k experts stream as one GEMV and no [pairs, H] rows go
    through memory to a reduce kernel. Each pair's product and weighted row are rounded to the dtype, then summed
    in float32 (the reference's roundings)."""
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, SLOTS)
    pair = token * TOP_K + slots
    real = slots < TOP_K
    wait_for_previous_kernel(PDL)  # ids (the route kernel's) and a (gate‖up's)
    expert = tl.load(ids_ptr + pair, mask=real, other=-1).to(tl.int64) - expert_start
    mine = real & (expert >= 0) & (expert < num_local)  # another rank's expert (parallel.ep) adds nothing here
    row_mask = mine[:, None] & (rows < N)[None, :]
    w_rows = w_ptr + tl.where(mine, expert, 0)[:, None] * stride_we + rows.to(tl.int64)[None, :] * stride_wn
    a_rows = a_ptr + pair * stride_am
    cols = tl.arange(0, BLOCK_K)
    mask = row_mask[:, :, None] & (cols < K)[None, None, :]
    w = tl.load(w_rows[:, :, None] + cols[None, None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    acc = tl.zeros([SLOTS, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_rows[:, None] + k0 + cols[None, :], mask=mine[:, None] & (k0 + cols < K)[None, :],
                    other=0.0).to(tl.float32)
        nxt = k0 + BLOCK_K + cols
        mask = row_mask[:, :, None] & (nxt < K)[None, None, :]  # all false after the last tile: no traffic
        w_next = tl.load(w_rows[:, :, None] + nxt[None, None, :], mask=mask, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * a[:, None, :]
        w = w_next
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pair, mask=real, other=0.0)
    y = (y * weight[:, None]).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_om + rows, tl.sum(y, axis=0).to(dtype), mask=rows < N)


def default_launch(tokens: int, num_local: int, top_k: int = 1) -> MoeLaunch:
    """Until kernels.moe_shapes says otherwise: a step of at most 16 pairs runs them as GEMVs (BLOCK_M 1: nothing
    sorted, no padded rows); a decode step's few pairs per expert take 16-row tiles (tl.dot's least) spread over
    more column tiles; larger steps 64 × 64 (two accumulators: gate's and up's)."""
    if _INTERPRETED:
        return MoeLaunch(1, 32, 256, 4, 1, 1) if tokens * top_k <= 16 else MoeLaunch(16, 32, 32, 4, 1, 1)
    if tokens * top_k <= 16:
        return MoeLaunch(1, 8, 256, 4, 1, 1)
    if tokens <= num_local:
        return MoeLaunch(16, 64, 64, 4, 3, 1)
    return MoeLaunch(64, 64, 64, 4, 3, 8)


def launch_for(tokens: int, num_local: int, inter: int, hidden: int, top_k: int = 1,
               device_name: Optional[str] = None) -> MoeLaunch:
    """kernels.moe_shapes' launch for this layer shape and step size, else the one measured on this GPU model
    (kernels/moe_launches.py), else the default."""
    shape = (num_local, inter, hidden)
    for table in (settings.current.moe_shapes, _measured(device_name)):
        for bound, launch in table.get(shape, ()):
            if bound is None or tokens <= bound:
                return launch
    return default_launch(tokens, num_local, top_k)


@functools.lru_cache(maxsize=None)
def _measured(device_name: Optional[str]) -> MoeShapes:
    return parse_moe_shapes(MOE_SHAPES_BY_DEVICE.get(device_name, ""))


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _precision(x: torch.Tensor) -> str:
    if not x.is_cuda:
        return "ieee"
    return "tf32x3" if x.dtype == torch.float32 else "tf32"  # 16-bit inputs: their own tensor-core dot


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: Optional[int] = None) -> torch.Tensor:
    """x [T, H] through experts topk_ids [T, k] with weights topk_weights [T, k] float32; w13 [E_local, 2I, H],
    w2 [E_local, H, I] hold every expert (expert_start None), or, expert parallel, experts expert_start ..
    expert_start + E_local - 1 of the ids. → [T, H] in x's dtype."""
    tokens, hidden = x.shape
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert w13.is_contiguous() and w2.is_contiguous() and w2.shape == (num_local, hidden, inter)
    device_name = _device_name(x.device.index or 0) if x.is_cuda else None
    launch = launch_for(tokens, num_local, inter, hidden, top_k, device_name)
    if pairs == 0:
        return torch.zeros((tokens, hidden), dtype=x.dtype, device=x.device)
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    if launch.block_m == 1:  # each pair its own GEMV programs: a decode step's few pairs, nothing to sort
        ids = topk_ids.reshape(-1)
        use_pdl = pdl.enabled(x, "moe")
        flavor = pdl.flavor(use_pdl, "moe")
        _pair_gate_up_kernel[(pairs, triton.cdiv(inter, launch.block_n))](
            x, w13, act, ids, inter, hidden, expert_start or 0, num_local, x.stride(0), w13.stride(0), w13.stride(1),
            act.stride(0), TOP_K=top_k, PDL=flavor, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
            num_warps=launch.warps, launch_pdl=use_pdl)
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
        # the summing kernel's tile is top_k (to a power of two) × BLOCK_N × BLOCK_K: BLOCK_N shrinks to keep it
        slots = triton.next_power_of_2(top_k)
        block_n = max(1, launch.block_n // slots)
        _pair_down_sum_kernel[(tokens, triton.cdiv(hidden, block_n))](
            act, w2, out, weights, ids, hidden, inter, expert_start or 0, num_local, act.stride(0), w2.stride(0),
            w2.stride(1), out.stride(0), TOP_K=top_k, SLOTS=slots, PDL=flavor, BLOCK_N=block_n,
            BLOCK_K=launch.block_k, num_warps=launch.warps, launch_pdl=use_pdl)
        return out
    # the rows of pairs whose expert is another rank's are never written: they must read zero
    rows = (torch.empty if expert_start is None else torch.zeros)((pairs, hidden), dtype=x.dtype, device=x.device)
    sorted_pairs, block_expert, padded = align(topk_ids, num_local, expert_start or 0, launch.block_m)
    num_m = block_expert.shape[0]
    common = dict(UPCAST=not x.is_cuda, PRECISION=_precision(x), BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                  BLOCK_K=launch.block_k, GROUP_M=launch.group_m, num_warps=launch.warps, num_stages=launch.stages)
    _gate_up_kernel[(num_m * triton.cdiv(inter, launch.block_n),)](
        x, w13, act, sorted_pairs, block_expert, padded, inter, hidden, pairs, num_m, x.stride(0), w13.stride(0),
        w13.stride(1), act.stride(0), TOP_K=top_k, **common)
    _down_kernel[(num_m * triton.cdiv(hidden, launch.block_n),)](
        act, w2, rows, weights, sorted_pairs, block_expert, padded, hidden, inter, pairs, num_m, act.stride(0),
        w2.stride(0), w2.stride(1), rows.stride(0), **common)
    return rows.view(tokens, top_k, hidden).sum(dim=1)
