"""The fp8 MLP's middle (kernels/fp8_gated_quant.py: the gate‖up GEMM's sums → act(gate) · up → e4m3 with a scale per
token) at Qwen2-7B's width, timed by how its values are divided by their row's scale: through the row's reciprocal
and one FMA (`e4m3.e4m3_of`, as served with the row's own absmax scale) against div.rn a value (as a clipped scale
takes: here scale_ub = inf, which clips nothing), with the sums already scaled (no channel scales read: what the
2 x 18,944 float32 channel scales a row cost). At 1aa8d7a (H100) the served kernel took 14.1 / 101.0 µs at 160 /
2,010 rows (1.89 TB/s at 2,010), dividing 17.0 / 124.6, without channel scales 12.0 / 92.5; 16 warps x 64
registers, 16 uncapped, 8 x 128 and a persistent program an SM with its next rows' loads in flight lost
(docs/performance.md).
Each variant's bytes are checked against the division's (the unscaled ones against the served unscaled kernel's).
One JSON line per (rows, variant): µs a call (CUDA graph of 20 calls over --copies inputs, so each reads HBM, not
L2, median of 5) and the GB/s of its reads and writes.

    python scripts/bench_gated_quant.py [--rows 160 2010] [--inner 18944]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from llaunch.kernels.fp8_gated_quant import gated_quantize
from bench_fp8_gemm import timed_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[160, 2010])
    ap.add_argument("--inner", type=int, default=18944)
    ap.add_argument("--copies", type=int, default=8, help="inputs cycled through (more than L2 holds together)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in args.rows:
        ys = [(torch.randn(m, 2 * args.inner, device="cuda", generator=g) * 60).to(torch.bfloat16)
              for _ in range(args.copies)]
        rows = (torch.rand(m, device="cuda", generator=g) * 0.02 + 1e-3).contiguous()
        channels = (torch.rand(2 * args.inner, device="cuda", generator=g) * 0.01 + 1e-4).contiguous()
        moved = m * args.inner * (4 + 1)  # bf16 gate and up read, e4m3 written
        served = [("division", True, lambda y, r, c: gated_quantize(y, torch.bfloat16, r, c, math.inf)),
                  ("reciprocal", True, lambda y, r, c: gated_quantize(y, torch.bfloat16, r, c)),
                  ("reciprocal, sums scaled", False, lambda y, r, c: gated_quantize(y, torch.bfloat16))]
        for name, scaled, quantize in served:
            r, c = (rows, channels) if scaled else (None, None)
            want = served[0][2](ys[0], r, c) if scaled else served[2][2](ys[0], r, c)
            got = quantize(ys[0], r, c)
            same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
            turn = iter(range(1 << 30))
            us = timed_us(lambda: quantize(ys[next(turn) % args.copies], r, c))
            print(json.dumps({"rows": m, "inner": args.inner, "variant": name, "us": round(us, 2),
                              "gb_s": round(moved / us / 1e3, 1), "bytes_as_served": same}), flush=True)


if __name__ == "__main__":
    main()
