"""The mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE and Mixtral, fused as vLLM's fused_moe.

`moe_route`: one program per token: the float32 softmax of its router logits, the top-k by repeated argmax
(the lower expert on a tie), renormalized to sum to 1 where the model says so.

`fused_moe`: every (token, k) pair goes to its expert. The pairs are sorted by expert and each expert's run is
padded to BLOCK_M (`align`, torch ops without a host sync, so decode graphs capture it); then two grouped GEMMs,
each program one BLOCK_M run of a single expert: gate‖up with the SiLU-and-multiply in its epilogue ([pairs, I]),
and down with the routing weight in its epilogue ([pairs, H]); a token's k rows are summed back in token order.
Pairs whose expert another rank holds (parallel.ep) are computed nowhere here: their rows stay zero.

The roundings are the reference's (kernels/reference.py fused_moe): gate and up, silu(gate), the product, the
down product and the weighted row each rounded to the model's dtype. Launch shapes: kernels.moe_shapes per layer
shape (kernels/settings.py), else `default_launch`.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from llaunch.kernels import settings
from llaunch.kernels.settings import MoeLaunch

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
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
        _route_kernel[(tokens,)](router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
                                 RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(experts),
                                 BLOCK_TOP=triton.next_power_of_2(top_k), num_warps=1 if experts <= 128 else 4)
    return weights, ids


def align(topk_ids: torch.Tensor, num_local: int, expert_start: int, block_m: int):
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m. → (sorted_pairs [max_blocks *
    block_m + 1] int32: pair index t * k + j, or the pair count in padding; block_expert [max_blocks] int32: the
    local expert of each run of block_m; padded [1]: the used length, blocks past it exit at once). Pairs of experts
    outside [expert_start, expert_start + num_local) are left out (the last element is where they are dropped)."""
    pairs = topk_ids.numel()
    local = topk_ids.reshape(-1).to(torch.int64) - expert_start
    bucket = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: another rank's
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=local.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded_counts = (counts[:num_local] + block_m - 1) // block_m * block_m
    ends = padded_counts.cumsum(0)
    # at most min(pairs, experts) runs are non-empty, each wasting under block_m rows
    max_blocks = triton.cdiv(pairs + min(pairs, num_local) * (block_m - 1), block_m)
    dropped = max_blocks * block_m
    order = torch.argsort(bucket, stable=True)  # by expert, pair order within one
    in_bucket = torch.arange(pairs, device=local.device) - (counts.cumsum(0) - counts)[bucket[order]]
    starts = torch.cat([ends - padded_counts, torch.full((1,), dropped, dtype=torch.int64, device=local.device)])
    sorted_pairs = torch.full((dropped + 1,), pairs, dtype=torch.int32, device=local.device)
    sorted_pairs.scatter_(0, torch.where(bucket[order] < num_local, starts[bucket[order]] + in_bucket, dropped),
                          order.to(torch.int32))
    block_starts = torch.arange(0, dropped, block_m, device=local.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_local - 1).to(torch.int32)
    return sorted_pairs, block_expert, ends[-1:]


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


def default_launch(tokens: int, num_local: int) -> MoeLaunch:
    """Until kernels.moe_shapes says otherwise: a decode step's few pairs per expert take 16-row tiles (tl.dot's
    least) spread over more column tiles; larger steps 64 × 64 (two accumulators: gate's and up's)."""
    if _INTERPRETED:
        return MoeLaunch(16, 32, 32, 4, 1, 1)
    if tokens <= num_local:
        return MoeLaunch(16, 64, 64, 4, 3, 1)
    return MoeLaunch(64, 64, 64, 4, 3, 8)


def launch_for(tokens: int, num_local: int, inter: int, hidden: int) -> MoeLaunch:
    """kernels.moe_shapes' launch for this layer shape and step size, else the default."""
    for bound, launch in settings.current.moe_shapes.get((num_local, inter, hidden), ()):
        if bound is None or tokens <= bound:
            return launch
    return default_launch(tokens, num_local)


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
    launch = launch_for(tokens, num_local, inter, hidden)
    sorted_pairs, block_expert, padded = align(topk_ids, num_local, expert_start or 0, launch.block_m)
    num_m = block_expert.shape[0]
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    # the rows of pairs whose expert is another rank's are never written: they must read zero
    rows = (torch.empty if expert_start is None else torch.zeros)((pairs, hidden), dtype=x.dtype, device=x.device)
    if pairs == 0:
        return rows.view(tokens, top_k, hidden).sum(dim=1)
    common = dict(UPCAST=not x.is_cuda, PRECISION=_precision(x), BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                  BLOCK_K=launch.block_k, GROUP_M=launch.group_m, num_warps=launch.warps, num_stages=launch.stages)
    _gate_up_kernel[(num_m * triton.cdiv(inter, launch.block_n),)](
        x, w13, act, sorted_pairs, block_expert, padded, inter, hidden, pairs, num_m, x.stride(0), w13.stride(0),
        w13.stride(1), act.stride(0), TOP_K=top_k, **common)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(num_m * triton.cdiv(hidden, launch.block_n),)](
        act, w2, rows, weights, sorted_pairs, block_expert, padded, hidden, inter, pairs, num_m, act.stride(0),
        w2.stride(0), w2.stride(1), rows.stride(0), **common)
    return rows.view(tokens, top_k, hidden).sum(dim=1)
