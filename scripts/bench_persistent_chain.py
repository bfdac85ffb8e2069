"""Experiment: can one persistent kernel stream a chain of one-row GEMVs faster than a kernel per
GEMV with PDL? (docs/benchmarks.md, "Batch-1 decode, fifth session": the step loses ~0.44 ms to the
ramp and drain of its 112 GEMV kernels.)

The chain is L layers of two GEMVs shaped like Qwen2-7B's MLP without the gating: A = [2I × H]
(gate‖up's bytes) then B = [H × 2I] (down's shape, twice its K), each layer's B reading A's output
and the next layer's A reading B's. Weights are distinct per layer, so nothing stays in L2.

- baseline: kernels/gemv.py's register GEMV, one kernel per GEMV, PDL, replayed from a CUDA graph;
- persistent (Gluon, Hopper): one launch for the whole chain. Each program walks its share of
  every phase's weight tiles through a TMA ring in shared memory. Phases are split evenly over the
  programs as k-major chunks of CH tiles (split-K): a program adds its fp32 partial sums into the
  phase's output with atomics, and the next phase rounds them to bf16 as it loads them. Between
  phases a program waits on a device-side counter, but the ring keeps the next phase's weight
  tiles coming, since weights do not depend on the barrier. `chain_kernel_ws` moves the TMA
  requests to a producer warp (warp specialization) and releases stages through mbarriers.

    python scripts/bench_persistent_chain.py [--layers 12] [--configs WS/PER_SM/STAGES/CHA/CHB/BLOCK_N,...]
                                             [--read-patterns]

Needs an sm90 GPU and Triton with Gluon (3.6 on the GPU image). A grid barrier needs every program
resident at once: PER_SM programs an SM must fit its shared memory and registers, or the launch
hangs (run it under `timeout`). Results: docs/benchmarks.md, "Batch-1 decode, fifth session" (a
prototype: 3.98 TB/s at best against the kernel chain's 4.11–4.21).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

H, I2 = 3584, 2 * 18944
BN, BK = 16, 256


@gluon.jit
def _coords(layer, r, n_a, start_a, start_b, NA: gl.constexpr, NB: gl.constexpr, RA: gl.constexpr,
            RB: gl.constexpr, CHA: gl.constexpr, CHB: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """The r-th tile of this program's share of a layer: (is phase A, row block, k tile in its chunk,
    chunk, weight row, column). Divisions by constants only: the loop carries (layer, r)."""
    is_a = r < n_a
    ta = start_a + r
    tb = start_b + r - n_a
    chunk = gl.where(is_a, ta // (RA * CHA), tb // (RB * CHB))
    block = gl.where(is_a, (ta // CHA) % RA, (tb // CHB) % RB)
    kt = gl.where(is_a, ta % CHA, tb % CHB)
    w_row = gl.where(is_a, layer * NA, layer * NB) + block * BN
    col = (chunk * gl.where(is_a, CHA, CHB) + kt) * BK
    return is_a, block, kt, chunk, w_row, col


@gluon.jit
def _issue(j, layer, r, a_desc, b_desc, ring, bars, n_a, start_a, start_b, NA: gl.constexpr, NB: gl.constexpr,
           RA: gl.constexpr, RB: gl.constexpr, CHA: gl.constexpr, CHB: gl.constexpr, BN: gl.constexpr,
           BK: gl.constexpr, STAGES: gl.constexpr):
    is_a, block, kt, chunk, w_row, col = _coords(layer, r, n_a, start_a, start_b, NA, NB, RA, RB, CHA, CHB, BN, BK)
    s = j % STAGES
    mbarrier.expect(bars.index(s), BN * BK * 2)
    if is_a:
        tma.async_copy_global_to_shared(a_desc, [w_row, col], bars.index(s), ring.index(s))
    else:
        tma.async_copy_global_to_shared(b_desc, [w_row, col], bars.index(s), ring.index(s))


@gluon.jit
def _await_phase(counters_ptr, phase, P):
    """Wait until every program has finished the previous phase, whose output this phase reads."""
    if phase > 0:
        while gl.atomic_add(counters_ptr + phase - 1, 0, sem="acquire", scope="gpu") < P:
            pass
        gl.thread_barrier()


@gluon.jit
def _load_x_chunk(xs, base, chunk, ch, k_len, x_cols, CHP: gl.constexpr, BK: gl.constexpr):
    """A new chunk of the phase's input into shared memory: its CH tiles of fp32 sums, rounded to bf16."""
    gl.thread_barrier()
    for q in gl.static_range(CHP):
        offs = (chunk * ch + q) * BK + x_cols
        x = gl.load(base + offs, mask=(q < ch) & (offs < k_len), other=0.0, cache_modifier=".cg")
        xs.index(q).store(x.to(gl.bfloat16))
    gl.thread_barrier()


@gluon.jit
def _share(P, TA: gl.constexpr, TB: gl.constexpr):
    """This program's even share of each phase's TA / TB tiles: (count A, count B, first A, first B)."""
    pid = gl.program_id(0)
    start_a = pid * TA // P
    start_b = pid * TB // P
    return (pid + 1) * TA // P - start_a, (pid + 1) * TB // P - start_b, start_a, start_b


@gluon.jit
def _advance(layer, r, per_layer):
    """The next tile of this program's share: (layer, index in the layer's share)."""
    r += 1
    if r == per_layer:
        r = 0
        layer += 1
    return layer, r


@gluon.jit
def _tile_input(layer, r, n_a, n_b, start_a, start_b, xs, x_cols, acc_a_ptr, acc_b_ptr, counters_ptr, P,
                NA: gl.constexpr, KA: gl.constexpr, NB: gl.constexpr, KB: gl.constexpr, RA: gl.constexpr,
                RB: gl.constexpr, CHA: gl.constexpr, CHB: gl.constexpr, CHP: gl.constexpr, BN: gl.constexpr,
                BK: gl.constexpr):
    """Before a tile's multiply: at a phase's first tile wait for the previous phase, at a new chunk
    load its x. Returns (is phase A, row block, k tile in chunk, tiles a chunk, phase, last tile of
    this program's share of the phase)."""
    is_a, block, kt, chunk, w_row, col = _coords(layer, r, n_a, start_a, start_b, NA, NB, RA, RB, CHA, CHB, BN, BK)
    phase = 2 * layer + gl.where(is_a, 0, 1)
    first = (r == 0) | (r == n_a)
    last = (r == n_a - 1) | (r == n_a + n_b - 1)
    if first:
        _await_phase(counters_ptr, phase, P)
    ch = gl.where(is_a, CHA, CHB)
    if first | ((kt == 0) & (block == 0)):  # a new chunk of x
        k_len = gl.where(is_a, KA, KB)
        base = gl.where(is_a, acc_b_ptr + layer * KA, acc_a_ptr + layer * KB)
        _load_x_chunk(xs, base, chunk, ch, k_len, x_cols, CHP, BK)
    return is_a, block, kt, ch, phase, last


@gluon.jit
def _retire_tile(acc, is_a, block, kt, ch, phase, last, layer, rows_in_block, acc_a_ptr, acc_b_ptr, counters_ptr,
                 NA: gl.constexpr, NB: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    """After a tile's multiply: at the end of a row block's chunk add the partial sums into the phase's
    output; after the program's last tile of a phase, count it done. Returns the accumulator."""
    if (kt == ch - 1) | last:  # the end of this program's part of a row block's chunk
        out = gl.where(is_a, acc_a_ptr + layer * NA, acc_b_ptr + (layer + 1) * NB)
        gl.atomic_add(out + block * BN + rows_in_block, gl.sum(acc, axis=1), sem="relaxed")
        acc = gl.zeros([BN, BK], gl.float32, layout)
    if last:
        gl.thread_barrier()
        gl.atomic_add(counters_ptr + phase, 1, sem="release", scope="gpu")
    return acc


@gluon.jit
def chain_kernel(a_desc, b_desc, acc_a_ptr, acc_b_ptr, counters_ptr, L, P,
                 NA: gl.constexpr, KA: gl.constexpr, NB: gl.constexpr, KB: gl.constexpr,
                 CHA: gl.constexpr, CHB: gl.constexpr, CHP: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr, num_warps: gl.constexpr):
    RA: gl.constexpr = NA // BN
    RB: gl.constexpr = NB // BN
    n_a, n_b, start_a, start_b = _share(P, RA * KA // BK, RB * KB // BK)
    total = L * (n_a + n_b)

    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    x_layout: gl.constexpr = gl.SliceLayout(0, blocked)
    y_layout: gl.constexpr = gl.SliceLayout(1, blocked)
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], a_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xs = gl.allocate_shared_memory(gl.bfloat16, [CHP, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for stage in gl.static_range(STAGES):
        mbarrier.init(bars.index(stage), count=1)
    fence_async_shared()
    per_layer = n_a + n_b
    i_layer = 0  # the next tile to request: (layer, index in this program's share of the layer)
    i_r = 0
    for j in range(STAGES - 1):
        if j < total:
            _issue(j, i_layer, i_r, a_desc, b_desc, ring, bars, n_a, start_a, start_b, NA, NB, RA, RB, CHA, CHB, BN,
                   BK, STAGES)
        i_layer, i_r = _advance(i_layer, i_r, per_layer)

    acc = gl.zeros([BN, BK], gl.float32, blocked)
    rows_in_block = gl.arange(0, BN, layout=y_layout)
    x_cols = gl.arange(0, BK, layout=x_layout)
    layer = 0
    r = 0
    for j in range(total):
        gl.thread_barrier()  # every thread is done with the stage the next request overwrites
        fence_async_shared()
        if j + STAGES - 1 < total:
            _issue(j + STAGES - 1, i_layer, i_r, a_desc, b_desc, ring, bars, n_a, start_a, start_b, NA, NB, RA, RB,
                   CHA, CHB, BN, BK, STAGES)
        i_layer, i_r = _advance(i_layer, i_r, per_layer)
        is_a, block, kt, ch, phase, last = _tile_input(layer, r, n_a, n_b, start_a, start_b, xs, x_cols, acc_a_ptr,
                                                       acc_b_ptr, counters_ptr, P, NA, KA, NB, KB, RA, RB, CHA, CHB,
                                                       CHP, BN, BK)
        s = j % STAGES
        mbarrier.wait(bars.index(s), (j // STAGES) & 1)
        w = ring.index(s).load(blocked)
        xt = xs.index(kt).load(x_layout)
        acc += w.to(gl.float32) * xt.to(gl.float32)[None, :]
        acc = _retire_tile(acc, is_a, block, kt, ch, phase, last, layer, rows_in_block, acc_a_ptr, acc_b_ptr,
                           counters_ptr, NA, NB, BN, BK, blocked)
        layer, r = _advance(layer, r, per_layer)


@gluon.jit
def _ws_producer(a_desc, b_desc, ring, ready, empty, total, n_a, n_b, start_a, start_b, NA: gl.constexpr,
                 NB: gl.constexpr, RA: gl.constexpr, RB: gl.constexpr, CHA: gl.constexpr, CHB: gl.constexpr,
                 BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One warp requests every weight tile of this program, STAGES ahead of the consumer: weights do not
    wait for the grid barrier."""
    per_layer = n_a + n_b
    layer = 0
    r = 0
    for j in range(total):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # the first round passes: phase starts at 0
        _issue(j, layer, r, a_desc, b_desc, ring, ready, n_a, start_a, start_b, NA, NB, RA, RB, CHA, CHB, BN, BK,
               STAGES)
        layer, r = _advance(layer, r, per_layer)


@gluon.jit
def _ws_consumer(ring, ready, empty, xs, acc_a_ptr, acc_b_ptr, counters_ptr, P, total, n_a, n_b, start_a, start_b,
                 NA: gl.constexpr, KA: gl.constexpr, NB: gl.constexpr, KB: gl.constexpr, RA: gl.constexpr,
                 RB: gl.constexpr, CHA: gl.constexpr, CHB: gl.constexpr, CHP: gl.constexpr, BN: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    x_layout: gl.constexpr = gl.SliceLayout(0, blocked)
    y_layout: gl.constexpr = gl.SliceLayout(1, blocked)
    acc = gl.zeros([BN, BK], gl.float32, blocked)
    rows_in_block = gl.arange(0, BN, layout=y_layout)
    x_cols = gl.arange(0, BK, layout=x_layout)
    per_layer = n_a + n_b
    layer = 0
    r = 0
    for j in range(total):
        is_a, block, kt, ch, phase, last = _tile_input(layer, r, n_a, n_b, start_a, start_b, xs, x_cols, acc_a_ptr,
                                                       acc_b_ptr, counters_ptr, P, NA, KA, NB, KB, RA, RB, CHA, CHB,
                                                       CHP, BN, BK)
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        w = ring.index(s).load(blocked)
        xt = xs.index(kt).load(x_layout)
        acc += w.to(gl.float32) * xt.to(gl.float32)[None, :]
        gl.thread_barrier()  # every consumer warp has read the stage
        mbarrier.arrive(empty.index(s))
        acc = _retire_tile(acc, is_a, block, kt, ch, phase, last, layer, rows_in_block, acc_a_ptr, acc_b_ptr,
                           counters_ptr, NA, NB, BN, BK, blocked)
        layer, r = _advance(layer, r, per_layer)


@gluon.jit
def chain_kernel_ws(a_desc, b_desc, acc_a_ptr, acc_b_ptr, counters_ptr, L, P,
                    NA: gl.constexpr, KA: gl.constexpr, NB: gl.constexpr, KB: gl.constexpr,
                    CHA: gl.constexpr, CHB: gl.constexpr, CHP: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                    STAGES: gl.constexpr, num_warps: gl.constexpr):
    """chain_kernel with the weight requests in a producer warp of their own (warp specialization):
    the consumer warps only wait, multiply and add, and release each stage through an mbarrier."""
    RA: gl.constexpr = NA // BN
    RB: gl.constexpr = NB // BN
    n_a, n_b, start_a, start_b = _share(P, RA * KA // BK, RB * KB // BK)
    total = L * (n_a + n_b)
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], a_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xs = gl.allocate_shared_memory(gl.bfloat16, [CHP, BK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_ws_consumer, (ring, ready, empty, xs, acc_a_ptr, acc_b_ptr, counters_ptr, P, total, n_a, n_b, start_a,
                        start_b, NA, KA, NB, KB, RA, RB, CHA, CHB, CHP, BN, BK, STAGES, num_warps)),
        (_ws_producer, (a_desc, b_desc, ring, ready, empty, total, n_a, n_b, start_a, start_b, NA, NB, RA, RB, CHA,
                        CHB, BN, BK, STAGES)),
    ], [1], [40])


@triton.jit
def _read_rows_kernel(w_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The register GEMV's memory pattern without its arithmetic: a program sums its BLOCK_N rows
    over all of K, BLOCK_K columns at a time."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc += tl.load(w_ptr + rows[:, None] * K + (k0 + cols)[None, :], mask=(k0 + cols < K)[None, :], other=0.0,
                       eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))


def read_patterns(w2d: torch.Tensor) -> list[dict]:
    """TB/s of reading a [N, K] weight as the GEMVs do, for row segments of 512 B to whole rows."""
    n, k = w2d.shape
    out = torch.empty(n, device=w2d.device)
    rows = []
    for bn, bk, warps in ((8, 256, 4), (4, 512, 4), (2, 1024, 4), (4, 1024, 4), (1, 2048, 4), (2, 2048, 8),
                          (1, 4096, 8)):
        fn = lambda: _read_rows_kernel[(n // bn,)](w2d, out, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)  # noqa: E731
        ms = timed(fn)
        rows.append(dict(read=f"[{n} x {k}] in {bn} x {bk} tiles ({bk * 2} B a row segment), {warps} warps",
                         tb_s=round(w2d.numel() * 2 / ms / 1e9, 3)))
    return rows


def persistent_chain(wa, wb, x0, programs, stages, cha, chb, bn=BN, warps=4, ws=False, maxnreg=None):
    """wa [L, NA, KA], wb [L, NB, KB] bf16; x0 [KA] bf16 → every layer's B output, float32 [L + 1, NB]."""
    layers, na, ka = wa.shape
    _, nb, kb = wb.shape
    layout = gl.NVMMASharedLayout.get_default_for([bn, BK], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(wa.view(layers * na, ka), [bn, BK], layout)
    b_desc = TensorDescriptor.from_tensor(wb.view(layers * nb, kb), [bn, BK], layout)
    acc_a = torch.zeros(layers, na, dtype=torch.float32, device=wa.device)
    acc_b = torch.zeros(layers + 1, nb, dtype=torch.float32, device=wa.device)
    counters = torch.zeros(2 * layers, dtype=torch.int32, device=wa.device)

    def run():
        acc_a.zero_()
        acc_b.zero_()
        acc_b[0] = x0.float()
        counters.zero_()
        kernel = chain_kernel_ws if ws else chain_kernel
        kernel[(programs,)](a_desc, b_desc, acc_a, acc_b, counters, layers, programs, na, ka, nb, kb, cha, chb,
                            triton.next_power_of_2(max(cha, chb)), bn, BK, stages, num_warps=warps,
                            **({"maxnreg": maxnreg} if maxnreg else {}))
        return acc_b

    return run


def baseline_chain(wa, wb, x0):
    from llaunch.kernels import pdl
    from llaunch.kernels.gemv import gemv

    def run():
        h = x0.view(1, -1)
        outs = []
        for a, b in zip(wa, wb):
            h = gemv(gemv(h, a), b)
            outs.append(h)
        return outs

    with pdl.for_graphs():
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
    return graph, outs


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--configs", default="0/2/6/7/4/16,1/1/8/7/4/16,1/1/12/7/4/16,1/2/8/7/4/16,1/2/6/7/4/32",
                    help="warp-specialized (0/1)/programs per SM/STAGES/CHA/CHB/BLOCK_N, comma-separated")
    ap.add_argument("--read-patterns", action="store_true", help="also time plain reads of the weights")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    wa = (torch.randn(args.layers, I2, H, device=dev) / H ** 0.5).to(torch.bfloat16)
    wb = (torch.randn(args.layers, H, I2, device=dev) / I2 ** 0.5).to(torch.bfloat16)
    x0 = torch.randn(H, device=dev).to(torch.bfloat16)
    gb = (wa.numel() + wb.numel()) * 2 / 1e9
    graph, outs = baseline_chain(wa, wb, x0)
    ms = timed(graph.replay)
    ref = torch.stack([o[0].float() for o in outs])
    print(json.dumps(dict(chain="baseline: register GEMV per kernel, PDL, CUDA graph", layers=args.layers,
                          gb=round(gb, 2), ms=round(ms, 4), tb_s=round(gb / ms, 3))))
    if args.read_patterns:
        for row in read_patterns(wa.view(-1, H)) + read_patterns(wb.view(-1, I2)):
            print(json.dumps(row))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for cfg in args.configs.split(","):
        ws, per_sm, stages, cha, chb, bn = (int(v) for v in cfg.split("/"))
        # warp-specialized: the consumer's setmaxnreg needs the CTA's registers capped to fit 2 an SM
        run = persistent_chain(wa, wb, x0, sms * per_sm, stages, cha, chb, bn, ws=bool(ws),
                               maxnreg=128 if ws and per_sm > 1 else None)
        out = run()
        torch.cuda.synchronize()
        got = out[1:]
        cos = torch.nn.functional.cosine_similarity(got.to(torch.bfloat16).float(), ref, dim=-1)
        ms = timed(run)
        print(json.dumps(dict(chain="persistent" + (", warp-specialized" if ws else ""), per_sm=per_sm, stages=stages,
                              cha=cha, chb=chb, block_n=bn, ms=round(ms, 4), tb_s=round(gb / ms, 3),
                              min_cosine_per_layer=round(cos.min().item(), 5),
                              first_layer_max_diff=(got[0].to(torch.bfloat16).float() - ref[0]).abs().max().item())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
