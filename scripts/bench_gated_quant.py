"""The fp8 MLP's middle (kernels/fp8_gated_quant.py: the gate‖up GEMM's sums → act(gate) · up → e4m3 with a scale per
token) at Qwen2-7B's width, timed by how its values are divided by their row's scale: through the reciprocal and
one FMA (`e4m3.e4m3_by_own_scale`, as served since it came) against div.rn a value (as before), and with the sums
already scaled (no channel scales read: what the 2 × 18,944 float32 channel scales a row cost). At b6f9417 (H100,
profiled in a c256-like mixed step) the kernel took 127 µs a layer at 2,010 rows: ~1.5 TB/s of its 190 MB, where
its sm_90 build issues ~53 instructions a value (40 through the reciprocal) in one 1,024-thread program an SM.
Each variant's bytes are checked against the division's. One JSON line per (rows, variant): µs a call (CUDA graph
of 20 calls over --copies inputs, so each reads HBM, not L2, median of 5) and the GB/s of its reads and writes.

    python scripts/bench_gated_quant.py [--rows 160 2010] [--inner 18944]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from llaunch.kernels import fp8_gated_quant as gq
from bench_fp8_gemm import timed_us


def run(y, rows, channels, own_scale: bool):
    """gated_quantize's launch with OWN_SCALE chosen (the wrapper derives it from the scale's kind)."""
    m, inner = y.shape[0], y.shape[1] // 2
    q = torch.empty((m, inner), dtype=torch.float8_e4m3fn, device=y.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=y.device)
    scaled = rows is not None
    block, tail = gq.row_blocks(inner)
    gq._gated_quant_kernel[(m,)](
        y, rows if scaled else scales, channels if scaled else scales, q, scales, scales, inner, y.stride(0),
        q.stride(0), 0.0, SCALED=scaled, STATIC=False, HAS_UB=False, ACT=0, DTYPE=0, BLOCK=block, TAIL=tail,
        ONE_PASS=True, OWN_SCALE=own_scale, INTERPRETED=False,
        num_warps=min(32, max(4, triton.next_power_of_2((block + tail) // 1024))))
    return q, scales


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
        for name, scaled, own in (("division", True, False), ("reciprocal", True, True),
                                  ("reciprocal, sums scaled", False, True)):
            r, c = (rows, channels) if scaled else (None, None)
            want = run(ys[0], r, c, False)
            got = run(ys[0], r, c, own)
            same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
            turn = iter(range(1 << 30))
            us = timed_us(lambda: run(ys[next(turn) % args.copies], r, c, own))
            print(json.dumps({"rows": m, "inner": args.inner, "variant": name, "us": round(us, 2),
                              "gb_s": round(moved / us / 1e3, 1), "bytes_as_division": same}), flush=True)


if __name__ == "__main__":
    main()
