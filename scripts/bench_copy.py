"""The GPU's copy bandwidth: what a decode step's weight reads are held against (docs/performance.md's bounds, e.g.
a model's batch-1 tok/s bound = copy bandwidth / bytes of weights a token reads), measured on the machine that runs
the benchmark beside it, since machines of one kind differ and kinds differ more (H200 4.26 TB/s, 2026-12-01).

    python scripts/bench_copy.py [--gib 4] [--repeats 20]

Prints one JSON line: {"device", "copy_tbps": (bytes read + bytes written) / time of the fastest copy}.
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0, help="the buffer copied (far above the L2 cache)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    n = int(args.gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    print(json.dumps({"device": torch.cuda.get_device_name(), "bytes": 2 * n, "copy_tbps": round(2 * n / best / 1e12, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
