"""The fp8 MLP's middle (kernels/fp8_gated_quant.py: the gate‖up GEMM's sums → act(gate) · up → e4m3 with a scale per
token) at Qwen2-7B's width, timed by how its values are divided by their row's scale: through the row's reciprocal
and one FMA (`e4m3.e4m3_of`, as served with the row's own absmax scale) against div.rn a value (as a clipped scale
takes: here scale_ub = inf, which clips nothing), and with the sums already scaled (no channel scales read: what the
2 × 18,944 float32 channel scales a row cost), and as served at other launches: a program of 16 warps capped at 64
registers a thread (two programs an SM, so one's loads overlap another's arithmetic; the build spills) or uncapped,
8 warps at 128. At 0eafbd5 (H100) the served kernel took 14.1 / 100.7 µs at 160 / 2,010 rows (1.89 TB/s at 2,010),
dividing 17.0 / 124.6, without channel scales 11.8 / 92.5. Each variant's bytes are checked against the division's.
One JSON line per (rows, variant): µs a call (CUDA graph of 20 calls over --copies inputs, so each reads HBM, not
L2, median of 5) and the GB/s of its reads and writes.

    python scripts/bench_gated_quant.py [--rows 160 2010] [--inner 18944]
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from llaunch.kernels import fp8_gated_quant
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
        for name, scaled, clip, launch in (("division", True, math.inf, None), ("reciprocal", True, None, None),
                                           ("reciprocal, sums scaled", False, None, None),
                                           ("reciprocal, 16 warps x 64 registers", True, None, (16, 64)),
                                           ("reciprocal, 16 warps", True, None, (16, None)),
                                           ("reciprocal, 8 warps x 128 registers", True, None, (8, 128))):
            r, c = (rows, channels) if scaled else (None, None)
            fp8_gated_quant.ONE_PASS_WARPS, fp8_gated_quant.MAX_REGISTERS = launch or (32, None)
            want = gated_quantize(ys[0], torch.bfloat16, r, c, math.inf)
            got = gated_quantize(ys[0], torch.bfloat16, r, c, clip)
            same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
            turn = iter(range(1 << 30))
            us = timed_us(lambda: gated_quantize(ys[next(turn) % args.copies], torch.bfloat16, r, c, clip))
            print(json.dumps({"rows": m, "inner": args.inner, "variant": name, "us": round(us, 2),
                              "gb_s": round(moved / us / 1e3, 1), "bytes_as_division": same}), flush=True)


if __name__ == "__main__":
    main()
