"""fp8 GEMMs of few rows (decode steps of 16-256 rows) on the Qwen2-7B linears: which kernel streams the e4m3
weights fastest. cuBLASLt runs the row-wise scaled GEMM in 128 x 128 tiles at 64-320 rows
(scripts/profile_kernels.py: 64 rows 3.47 ms a step for the fp8 GEMMs against bf16's 3.61), far from the
half that fp8's bytes allow. Each launch takes the next of --copies weights, so a weight comes from memory,
not L2, as in a model's step. Timed here, each (shape, M): bf16 cuBLAS; torch._scaled_mm with row-wise scales
(as served), with one scale per tensor, and with unit per-tensor scales, float32 or bfloat16 out and the row-wise
scales in a Triton epilogue (the same products and sums as row-wise; bfloat16 out rounds once more); a Triton tile GEMM (e4m3 x e4m3 on the tensor cores, float32
accumulation, scales in the epilogue) over tile shapes and splits of K, its output checked against
_scaled_mm's. One JSON line per (shape, M, method): microseconds (CUDA events, median of 5 replays of 20
launches captured in a CUDA graph) and the weight bytes per second; then per M the four linears' sum per method
(what a layer reads).

    python scripts/bench_fp8_gemm.py [--rows 16 32 64 128 165 256]
    python scripts/bench_fp8_gemm.py --rows 512 1024 2048 --no-triton   (mixed steps' sizes)
    TRITON_INTERPRET=1 python scripts/bench_fp8_gemm.py --cpu   (a smoke run of the Triton kernel's arithmetic)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from llaunch.kernels.fp8_epilogue import scale_rows_and_channels

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SHAPES = {"qkv": (4608, 3584), "o_proj": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


@triton.jit
def _skinny_kernel(a_ptr, b_ptr, out_ptr, as_ptr, bs_ptr, M, N, K, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    """out[split, m, n] = (sum over this split's K of a[m, k] b[n, k]) * as[m] * bs[n]."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_in, n_in = offs_m < M, offs_n < N
    k_start = split * k_per_split
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + k_start + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * K + k_start + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, k_per_split, BLOCK_K, num_stages=STAGES):
        k_in = k_start + k0 + offs_k < K
        a = tl.load(a_ptrs + k0, mask=m_in[:, None] & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=k_in[:, None] & n_in[None, :], other=0.0)
        if INTERPRETED:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
    a_s = tl.load(as_ptr + offs_m, mask=m_in, other=0.0)
    acc *= a_s[:, None] * tl.load(bs_ptr + offs_n, mask=n_in, other=0.0)[None, :]
    out = out_ptr + split * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


def skinny(q, a_scale, w, w_scale, block_m, block_n, block_k, split, stages, warps):
    m, k = q.shape
    n = w.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((split, m, n), dtype=torch.float32 if split > 1 else torch.bfloat16, device=q.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _skinny_kernel[grid](q, w, out, a_scale, w_scale, m, n, k, k_per_split, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k, STAGES=stages, INTERPRETED=INTERPRETED, num_warps=warps)
    return out[0] if split == 1 else out.sum(0).to(torch.bfloat16)


def scaled_epilogue(y: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y · row scale · channel scale in bf16: the served epilogue (kernels.fp8_gemm=tensor_epilogue)."""
    return scale_rows_and_channels(y, a_scale, w_scale, None, torch.bfloat16)


def timed_us(fn) -> float:
    """Device time per call of 20 calls replayed from one CUDA graph (as the decode steps run): eager launches of
    a short GEMM plus a Triton epilogue measured the host's launch time instead (2026-12-04: 267 µs a layer)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiled and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1000 / 20)
    return statistics.median(runs)


def configs(m: int):
    block_ms = [bm for bm in (16, 32, 64, 128) if bm >= min(m, 128) // 2 and bm <= max(16, triton.next_power_of_2(m))]
    for bm, bn, split, stages in itertools.product(block_ms, (64, 128), (1, 2, 4), (3, 4)):
        yield dict(block_m=bm, block_n=bn, block_k=128, split=split, stages=stages, warps=4)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 165, 256])
    ap.add_argument("--copies", type=int, default=8, help="distinct weights per shape, used in turn (L2 holds ~50 MB)")
    ap.add_argument("--cpu", action="store_true", help="a smoke run of the Triton kernels (TRITON_INTERPRET=1)")
    ap.add_argument("--no-triton", action="store_true",
                    help="cuBLAS(Lt) and the epilogue only, not the Triton tile GEMM's sweep (mixed-step sizes)")
    args = ap.parse_args()
    if args.cpu:
        torch.manual_seed(0)
        q = (torch.randn(20, 300) * 50).to(torch.float8_e4m3fn)
        w = (torch.randn(70, 300) * 50).to(torch.float8_e4m3fn)
        a_s, w_s = torch.rand(20) + 0.5, torch.rand(70) + 0.5
        want = (q.float() @ w.float().t()) * a_s[:, None] * w_s[None, :]
        got = skinny(q, a_s, w, w_s, 16, 32, 128, 2, 1, 4).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        raw = q.float() @ w.float().t()
        epi = ((scaled_epilogue(raw, a_s, w_s).float() - want).abs().max() / want.abs().max()).item()
        epi = max(epi, ((scaled_epilogue(raw.to(torch.bfloat16), a_s, w_s).float() - want).abs().max()
                        / want.abs().max()).item())
        print(json.dumps(dict(check="triton vs float32", max_rel_err=err, epilogue_max_rel_err=epi)))
        return 0 if max(err, epi) < 1e-2 else 1
    dev = torch.device("cuda")
    totals: dict = {}
    for m in args.rows:
        for name, (n, k) in SHAPES.items():
            torch.manual_seed(0)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            a_scale = x.abs().amax(1, keepdim=True).float() / 448
            q = (x.float() / a_scale).to(torch.float8_e4m3fn)
            a_flat = a_scale.view(-1).contiguous()
            # --copies distinct weights, used in turn: a model's layers each read their own from memory
            w16s, w8s, w_scales = [], [], []
            for _ in range(args.copies):
                w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
                w_scale = w16.abs().amax(1).float() / 448
                w16s.append(w16)
                w8s.append((w16.float() / w_scale[:, None]).to(torch.float8_e4m3fn))
                w_scales.append(w_scale)
            turn = itertools.count()
            one = torch.ones((), device=dev)
            want = torch._scaled_mm(q, w8s[0].t(), scale_a=a_scale, scale_b=w_scales[0].view(1, -1),
                                    out_dtype=torch.bfloat16)

            def rowwise(i):
                return torch._scaled_mm(q, w8s[i].t(), scale_a=a_scale, scale_b=w_scales[i].view(1, -1),
                                        out_dtype=torch.bfloat16)

            def tensor_f32_epilogue(i):
                y = torch._scaled_mm(q, w8s[i].t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
                return scaled_epilogue(y, a_flat, w_scales[i])

            def tensor_bf16_epilogue(i):
                # the unscaled sums rounded to bf16 (a relative rounding: their magnitude does not matter),
                # then the row × channel scales: one rounding more than row-wise, cuBLASLt's per-tensor kernel
                y = torch._scaled_mm(q, w8s[i].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                return scaled_epilogue(y, a_flat, w_scales[i])

            methods = {
                "bf16": lambda i: torch.nn.functional.linear(x, w16s[i]),
                "scaled_mm_rowwise": rowwise,
                "scaled_mm_tensor": lambda i: torch._scaled_mm(q, w8s[i].t(), scale_a=one, scale_b=one,
                                                               out_dtype=torch.bfloat16),
                "tensor_f32_epilogue": tensor_f32_epilogue,
                "tensor_bf16_epilogue": tensor_bf16_epilogue,
            }
            for method in ("tensor_f32_epilogue", "tensor_bf16_epilogue"):
                err = ((methods[method](0).float() - want.float()).abs().max() / want.float().abs().max()).item()
                if err > 2e-2:
                    print(f"# {name} m={m} {method}: wrong (max rel err {err:.3g})", file=sys.stderr)
            row = {}
            for method, fn in methods.items():
                row[method] = timed_us(lambda fn=fn: fn(next(turn) % args.copies))
            best, best_cfg = float("inf"), None
            for cfg in ([] if args.no_triton else configs(m)):
                fn = lambda cfg=cfg: skinny(q, a_flat, w8s[next(turn) % args.copies], w_scales[0], **cfg)  # noqa: E731
                try:
                    err = ((skinny(q, a_flat, w8s[0], w_scales[0], **cfg).float() - want.float()).abs().max()
                           / want.float().abs().max()).item()
                    us = timed_us(fn)
                except Exception as e:  # a tile shape the compiler refuses (shared memory)
                    print(f"# {name} m={m} {cfg}: {type(e).__name__}", file=sys.stderr)
                    continue
                if err > 2e-2:
                    print(f"# {name} m={m} {cfg}: wrong (max rel err {err:.3g})", file=sys.stderr)
                    continue
                if us < best:
                    best, best_cfg = us, cfg
            if not args.no_triton:
                row["triton_best"] = best
            weight_bytes = n * k
            for method, us in row.items():
                per_byte = (weight_bytes * (2 if method == "bf16" else 1)) / (us * 1e-6) / 1e12
                print(json.dumps(dict(shape=name, m=m, method=method, us=round(us, 1), weight_tb_s=round(per_byte, 2),
                                      tflops=round(2 * m * n * k / (us * 1e-6) / 1e12, 1),
                                      **({"config": best_cfg} if method == "triton_best" else {}))))
                totals.setdefault(m, {}).setdefault(method, 0.0)
                totals[m][method] += us
            sys.stdout.flush()
    for m, row in totals.items():
        print(f"m={m:4d} a layer's four linears, us: " + "  ".join(f"{k} {v:7.1f}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
