"""GPU timing of every Triton kernel against its torch reference and against its floor.

The floor of an op is max(bytes it must move / bandwidth, FLOPs / bf16 matmul rate), the ceilings
measured on this GPU first: the bandwidth of a device-to-device copy (read + write counted) for ops
that write about as much as they read, of a streaming read for the GEMVs (which only read weights;
an H200 reads at ~4.7 TB/s but copies at ~4.2). Kernel times are medians of `triton.testing.do_bench` over CUDA
graph replays where the op can be captured (as decode runs in the engine), so Python launch cost
stays out; torch references are timed eagerly, cuBLAS ones (the GEMV's) in graphs as well. Shapes are Qwen2-7B's (28 q heads, 4 KV heads, head_dim
128, hidden 3584, intermediate 18944, vocab 152064) in bf16.

    python scripts/bench_kernels.py [--json results.json] [--sweep] [--ops gemv]

--sweep also times alternative launch shapes of the attention and GEMV kernels (to pick the defaults).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton

from llaunch.kernels import reference
from llaunch.kernels.dispatch import triton_ops

BF16 = torch.bfloat16
HIDDEN, INTER, VOCAB, HQ, HK, D = 3584, 18944, 152064, 28, 4, 128


@dataclass
class Case:
    op: str
    shape: str
    kernel: Callable[[], object]
    reference: Optional[Callable[[], object]]
    bytes: float
    flops: float = 0.0
    reference_in_graph: bool = False  # the reference is itself a GPU library call (cuBLAS): time it alike
    read_only: bool = False  # the bytes are reads (weights): the floor uses the streaming-read ceiling


def median_ms(fn: Callable[[], object], graph: bool) -> float:
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        except Exception as err:  # ops with a host sync cannot be captured: time them eagerly
            print(f"  (graph capture failed: {type(err).__name__}; timing eagerly)")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings() -> tuple[float, float, float]:
    """(bytes/s of a device-to-device copy counting read + write, bytes/s of a streaming read, bf16
    matmul FLOP/s)."""
    from bench_gemv_chain import read_ceiling  # scripts/ is on the path when this runs as a script

    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    copy_s = median_ms(lambda: dst.copy_(src), graph=False) / 1e3
    read = max(r["tb_per_s"] for r in read_ceiling(src.view(BF16))) * 1e12  # 1 GB: far past the L2
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    mm_s = median_ms(lambda: a @ b, graph=False) / 1e3
    return 2 * src.numel() * 4 / copy_s, read, 2 * 8192 ** 3 / mm_s


def _randn(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda").to(dtype)


def _kv_cache(lengths: list[int], kv_heads: int, dim: int):
    """Caches with randomly permuted token slots and the per-row slot table."""
    total = sum(lengths)
    k_cache, v_cache = _randn(total, kv_heads, dim), _randn(total, kv_heads, dim)
    perm = torch.randperm(total, device="cuda").to(torch.int32)
    req_to_slots = torch.zeros(len(lengths), max(lengths), dtype=torch.int32, device="cuda")
    start = 0
    for row, n in enumerate(lengths):
        req_to_slots[row, :n] = perm[start : start + n]
        start += n
    return k_cache, v_cache, req_to_slots, torch.arange(len(lengths), device="cuda")


def elementwise_cases(ops) -> list[Case]:
    cases = []
    for tokens in (4096, 64):
        x, res, w = _randn(tokens, HIDDEN), _randn(tokens, HIDDEN), _randn(HIDDEN)
        cases.append(Case("rmsnorm+residual", f"{tokens}x{HIDDEN}", lambda x=x, r=res, w=w: ops.rmsnorm(x, w, 1e-6, r),
                           lambda x=x, r=res, w=w: reference.rmsnorm(x, w, 1e-6, r), 2 * 4 * x.numel()))
        q, k = _randn(tokens, HQ, D), _randn(tokens, HK, D)
        cos, sin = reference.rope_cos_sin(D, 32768, 1e6, device="cuda")
        pos = torch.randint(0, 32768, (tokens,), device="cuda")
        cases.append(Case("rotary", f"{tokens}x({HQ}+{HK})x{D}",
                          lambda q=q, k=k, p=pos: ops.rotary_embedding(q, k, p, cos, sin),
                          lambda q=q, k=k, p=pos: reference.rotary_embedding(q, k, p, cos, sin),
                          2 * 2 * (q.numel() + k.numel()) + tokens * D * 4))
        kc, vc = _randn(8 * tokens, HK, D), _randn(8 * tokens, HK, D)
        slots = torch.randperm(8 * tokens, device="cuda")[:tokens]
        cases.append(Case("store_kv", f"{tokens}x{HK}x{D}",
                          lambda k=k, kc=kc, vc=vc, s=slots: ops.store_kv(kc, vc, s, k, k),
                          lambda k=k, kc=kc, vc=vc, s=slots: reference.store_kv(kc, vc, s, k, k), 4 * 2 * k.numel()))
        gu = _randn(tokens, 2 * INTER)
        cases.append(Case("silu_mul", f"{tokens}x2*{INTER}", lambda g=gu: ops.silu_mul(g),
                           lambda g=gu: reference.silu_mul(g), 2 * 1.5 * gu.numel()))
    return cases


def prefill_cases(attend) -> list[Case]:
    cases = []
    for chunks in ([(0, 4096)], [(0, 1024)] * 4, [(3072, 1024)]):
        k_cache, v_cache, r2s, rows = _kv_cache([p + n for p, n in chunks], HK, D)
        q_lens = torch.tensor([n for _, n in chunks], device="cuda")
        prefix = torch.tensor([p for p, _ in chunks], device="cuda")
        starts = torch.cumsum(q_lens, 0) - q_lens
        q = _randn(int(q_lens.sum()), HQ, D)
        args = (q, k_cache, v_cache, r2s, rows, starts, q_lens, prefix, D ** -0.5)
        visible = sum(n * (n + 1) / 2 + p * n for p, n in chunks)
        kv_bytes = sum(p + n for p, n in chunks) * HK * D * 2 * 2
        cases.append(Case("prefill_attention", "+".join(f"{p}:{n}" for p, n in chunks),
                          lambda a=args, m=max(n for _, n in chunks): attend(*a, max_q_len=m),
                          lambda a=args: reference.prefill_attention(*a), 2 * 2 * q.numel() + kv_bytes,
                          4 * D * HQ * visible))
    return cases


def decode_cases(attend) -> list[Case]:
    cases = []
    for batch, ctx in ((64, 1024), (1, 4096), (256, 1024), (64, 4096)):
        k_cache, v_cache, r2s, rows = _kv_cache([ctx] * batch, HK, D)
        q, seq_lens = _randn(batch, HQ, D), torch.full((batch,), ctx, device="cuda")
        args = (q, k_cache, v_cache, r2s, rows, seq_lens, D ** -0.5)
        cases.append(Case("decode_attention", f"B{batch} ctx{ctx}", lambda a=args, m=ctx: attend(*a, max_len=m),
                          lambda a=args: reference.decode_attention(*a), batch * ctx * HK * D * 2 * 2,
                          4 * D * HQ * batch * ctx))
    return cases


def gemv_cases(ops) -> list[Case]:
    """Batch-1 decode's linear layers: the GEMV kernel against cuBLAS (F.linear) on the same data."""
    cases = []
    for name, n, k, bias in (("qkv+bias", (HQ + 2 * HK) * D, HIDDEN, True), ("o_proj", HIDDEN, HQ * D, False),
                             ("down_proj", HIDDEN, INTER, False), ("lm_head", VOCAB, HIDDEN, False)):
        x, w = _randn(1, k), _randn(n, k) / k ** 0.5
        b = _randn(n) if bias else None
        cases.append(Case(f"gemv {name}", f"1x{k} @ {n}x{k}", lambda x=x, w=w, b=b: ops.gemv(x, w, b),
                          lambda x=x, w=w, b=b: torch.nn.functional.linear(x, w, b), 2 * w.numel(),
                          reference_in_graph=True, read_only=True))
    x, w = _randn(1, HIDDEN), _randn(2 * INTER, HIDDEN) / HIDDEN ** 0.5
    cases.append(Case("gemv gate_up+silu", f"1x{HIDDEN} @ {2 * INTER}x{HIDDEN}",
                      lambda: ops.gemv(x, w, gated=True),
                      lambda: ops.silu_mul(torch.nn.functional.linear(x, w)), 2 * w.numel(), reference_in_graph=True,
                      read_only=True))
    return cases


def sampling_cases(ops) -> list[Case]:
    batch = 64
    logits = 4 * torch.randn(batch, VOCAB, device="cuda")
    temp, top_p = torch.full((batch,), 0.8, device="cuda"), torch.full((batch,), 0.95, device="cuda")
    top_k = torch.full((batch,), 50, device="cuda")
    seeds, offs = torch.arange(batch, device="cuda"), torch.zeros(batch, dtype=torch.int64, device="cuda")
    counts = torch.randint(0, 3, (batch, VOCAB), device="cuda").float()
    seen = torch.rand(batch, VOCAB, device="cuda") < 0.1
    pen = (torch.rand(batch, device="cuda"), torch.rand(batch, device="cuda"), 1 + torch.rand(batch, device="cuda"))
    return [
        Case("apply_penalties", f"{batch}x{VOCAB}", lambda: ops.apply_penalties(logits, counts, *pen, seen),
             lambda: reference.apply_penalties(logits, counts, *pen, seen), logits.numel() * (4 + 4 + 1 + 4)),
        Case("sample top-k/p", f"{batch}x{VOCAB}", lambda: ops.sample(logits, temp, top_p, top_k, seeds, offs),
             lambda: reference.sample(logits, temp, top_p, top_k, seeds, offs), logits.numel() * 4),
        Case("sample no filter", f"{batch}x{VOCAB}",
             lambda: ops.sample(logits, temp, top_p, top_k, seeds, offs, top_filters=False), None, logits.numel() * 4),
    ]


def measure(case: Case, bandwidth: tuple[float, float], rate: float, with_reference: bool = True) -> dict:
    """bandwidth: (copy, streaming read) bytes/s."""
    case.kernel()  # compiles (host work) before any graph capture
    torch.cuda.synchronize()
    kernel_ms = median_ms(case.kernel, graph=True)
    ref_ms = (median_ms(case.reference, graph=case.reference_in_graph) if case.reference and with_reference
              else math.nan)
    floor_ms = 1e3 * max(case.bytes / bandwidth[1 if case.read_only else 0], case.flops / rate)
    return {"op": case.op, "shape": case.shape, "kernel_ms": kernel_ms, "reference_ms": ref_ms,
            "floor_ms": floor_ms, "of_floor": floor_ms / kernel_ms}


def sweep(ops, bandwidth: tuple[float, float], rate: float) -> list[dict]:
    """Alternative launch shapes for the attention and GEMV kernels (patched in for the duration)."""
    pre = importlib.import_module("llaunch.kernels.prefill_attention")
    dec = importlib.import_module("llaunch.kernels.decode_attention")
    rows = []
    default_pre, default_dec, default_target = pre._launch_shape, dec._launch_shape, dec._TARGET_PROGRAMS
    for shape in ((128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)):
        pre._launch_shape = lambda q, dim, s=shape: s
        for case in prefill_cases(ops.prefill_attention):
            rows.append({**measure(case, bandwidth, rate, False), "variant": f"M,N,warps,stages={shape}"})
    pre._launch_shape = default_pre
    for shape in ((64, 4, 2), (128, 4, 2), (128, 4, 3)):
        for target in (128, 256, 512):
            dec._launch_shape, dec._TARGET_PROGRAMS = (lambda q, dim, splits, s=shape: s), target
            for case in decode_cases(ops.decode_attention):
                variant = f"N,warps,stages={shape} target={target}"
                rows.append({**measure(case, bandwidth, rate, False), "variant": variant})
    dec._launch_shape, dec._TARGET_PROGRAMS = default_dec, default_target
    gemv = importlib.import_module("llaunch.kernels.gemv")
    default_gemv = gemv.launch_shape
    for shape in ((1, 2048, 4, 0), (2, 1024, 4, 0), (2, 4096, 8, 0), (4, 1024, 4, 0), (8, 512, 4, 0), (16, 256, 4, 0),
                  (8, 256, 4, 4), (8, 256, 4, 6), (16, 256, 4, 4)):
        gemv.launch_shape = lambda n, k, gated, s=shape: s
        for case in gemv_cases(ops):
            rows.append({**measure(case, bandwidth, rate, False),
                         "variant": f"BLOCK_N,BLOCK_K,warps,STAGES={shape}"})
    gemv.launch_shape = default_gemv
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'op':<20}{'shape':<26}{'variant':<38}{'kernel ms':>10}{'ref ms':>10}{'floor ms':>10}{'floor/kern':>11}")
    for r in rows:
        print(f"{r['op']:<20}{r['shape']:<26}{r.get('variant', ''):<38}{r['kernel_ms']:>10.4f}"
              f"{r['reference_ms']:>10.4f}{r['floor_ms']:>10.4f}{r['of_floor']:>10.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows and ceilings here")
    parser.add_argument("--sweep", action="store_true", help="also time alternative attention launch shapes")
    parser.add_argument("--ops", default="", help="only the ops whose name contains this (e.g. gemv)")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy, read, rate = ceilings()
    bandwidth = (copy, read)
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s, streaming read {read / 1e12:.2f} TB/s, "
          f"bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    ops = triton_ops()
    cases = (elementwise_cases(ops) + prefill_cases(ops.prefill_attention) + decode_cases(ops.decode_attention)
             + sampling_cases(ops) + gemv_cases(ops))
    cases = [case for case in cases if args.ops in case.op]
    rows = [measure(case, bandwidth, rate) for case in cases]
    print_table(rows)

    if args.sweep:
        variants = sweep(ops, bandwidth, rate)
        print_table(variants)
        rows += variants
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy, "read_bytes_per_s": read,
                       "bf16_flops_per_s": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
