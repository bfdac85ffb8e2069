"""Summarise a router step trace (llaunch router.step_trace=PATH ...): where a run's time went.

    python scripts/step_trace_report.py TRACE.jsonl[.gz] [--bins 10] [--starts] [--window START END]

Per step kind (decode only, verify: speculative decoding's verify chunks with or without decode rows, mixed decode +
prefill, prefill only): steps, time between consecutive
results, decode rows and prefill tokens per step and, with a GPU worker's timings, its host enqueue
and device time per step (a step whose enqueue exceeds its device time is host-bound); time with no
step in flight (the device idles for the host); the decode batch and prefill tokens over the run in
equal time bins. `--window`: only the steps sent in [START, END] (time.monotonic, as the trace). `--starts`: one line per step that
starts requests, splitting its latency (with a traced worker's timings): frontend → router (the
oldest new request's wait when planned), router → worker, the worker's host enqueue time, its device
time, and sent → returned. `--pipeline`: where the device waits between steps (a worker's timings
needed): each step's device start is taken as the later of its launch and the previous step's device end;
a gap is split into the wait for the plan (the router had not sent it: it plans a step once the result
`--depth` steps earlier is back) and the plan's way to a launch (transport, the worker busy).
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys


KINDS = ("decode", "verify", "mixed", "prefill")


def kind(r: dict) -> str:
    """decode; verify (speculative decoding: a verify chunk, perhaps beside decode rows); mixed (decode or verify
    rows beside a prefill chunk); prefill."""
    if r["prefill_tokens"]:
        return "mixed" if r["decode"] or r.get("verify") else "prefill"
    return "verify" if r.get("verify") else "decode"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--starts", action="store_true", help="latency split of each step that starts requests")
    ap.add_argument("--window", type=float, nargs=2, metavar=("START", "END"))
    ap.add_argument("--pipeline", action="store_true", help="the device's waits between steps, by cause")
    ap.add_argument("--depth", type=int, default=2, help="--pipeline: the router's steps in flight")
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open  # gpu_run.sh packs each server's trace as .jsonl.gz
    with opener(args.trace, "rt") as lines:
        steps = sorted((json.loads(line) for line in lines), key=lambda r: r["step"])
    if args.window:
        steps = [r for r in steps if args.window[0] <= r["sent"] <= args.window[1]]
    if not steps:
        print("empty trace")
        return 1
    start, end = steps[0]["sent"], steps[-1]["returned"]
    idle, last_return = 0.0, start
    for r in steps:  # a step sent after the previous one returned: nothing ran in between
        idle += max(0.0, r["sent"] - last_return)
        r["span"] = r["returned"] - max(r["sent"], last_return)
        last_return = max(last_return, r["returned"])
    print(f"{len(steps)} steps over {end - start:.2f} s; no step in flight for {idle:.2f} s")
    print(f"{'kind':8} {'steps':>6} {'time s':>8} {'ms/step':>8} {'decode rows':>11} {'prefill tok':>11} "
          f"{'enqueue ms':>10} {'device ms':>9} {'verify tok':>10}")
    for k in KINDS:
        group = [r for r in steps if kind(r) == k]
        if group:
            t = sum(r["span"] for r in group)
            timed = [r for r in group if "device_s" in r]
            host = f"{1000 * statistics.mean(r['launch_s'] for r in timed):10.2f}" if timed else f"{'-':>10}"
            device = f"{1000 * statistics.mean(r['device_s'] for r in timed):9.2f}" if timed else f"{'-':>9}"
            print(f"{k:8} {len(group):6d} {t:8.2f} {1000 * t / len(group):8.2f} "
                  f"{statistics.mean(r['decode'] for r in group):11.1f} "
                  f"{statistics.mean(r['prefill_tokens'] for r in group):11.1f} {host} {device} "
                  f"{statistics.mean(r.get('verify_tokens', 0) for r in group):10.1f}")
    width = (end - start) / args.bins
    print(f"\n{'t (s)':>8} {'steps':>6} {'decode rows':>11} {'prefill tok/s':>13} {'output tok/s':>12} {'waiting':>8}")
    for b in range(args.bins):
        lo, hi = start + b * width, start + (b + 1) * width
        group = [r for r in steps if lo <= r["returned"] < hi]
        if not group:
            continue
        # every chunk counted as sampling (an upper bound), a verify row as one token (its accepted ones untraced)
        out = sum(r["decode"] + r["chunks"] + r.get("verify", 0) for r in group)
        print(f"{lo - start:8.1f} {len(group):6d} {statistics.mean(r['decode'] for r in group):11.1f} "
              f"{sum(r['prefill_tokens'] for r in group) / width:13.0f} {out / width:12.0f} "
              f"{statistics.mean(r['waiting'] for r in group):8.1f}")
    if args.starts:
        print_starts(steps)
    if args.pipeline:
        print_pipeline(steps, args.depth)
    return 0


def device_gaps(steps: list[dict], depth: int) -> list[dict]:
    """Per timed step (consecutive steps in order): the device's idle time before it, split into the wait
    for the router's plan and the plan's way to a launch, and the router's turnaround (the result `depth`
    steps earlier back → this plan sent)."""
    out, device_end, by_step = [], None, {r["step"]: r for r in steps}
    for r in steps:
        if "device_s" not in r:
            device_end = None
            continue
        idle = plan_wait = 0.0
        if device_end is not None:
            idle = max(0.0, r["started"] - device_end)
            plan_wait = min(idle, max(0.0, r["sent"] - device_end))
        earlier = by_step.get(r["step"] - depth)
        turnaround = r["sent"] - earlier["returned"] if earlier and r["sent"] >= earlier["returned"] else None
        out.append(dict(kind=kind(r), idle=idle, plan_wait=plan_wait, to_launch=idle - plan_wait,
                        turnaround=turnaround, device=r["device_s"]))
        device_end = max(r["started"], device_end or 0.0) + r["device_s"]
    return out


def print_pipeline(steps: list[dict], depth: int) -> None:
    gaps = device_gaps(steps, depth)
    if not gaps:
        print("\nno worker timings in the trace (a GPU worker under router.step_trace records them)")
        return
    print(f"\n{'kind':8} {'steps':>6} {'device ms':>9} {'idle ms':>8} {'plan wait':>9} {'to launch':>9} "
          f"{'turnaround':>10} {'idle s':>7}  (ms a step; turnaround: result back -> plan {depth} steps on sent)")
    for k in KINDS:
        group = [g for g in gaps if g["kind"] == k]
        if not group:
            continue
        turn = [g["turnaround"] for g in group if g["turnaround"] is not None]
        mean = lambda key: 1000 * statistics.mean(g[key] for g in group)  # noqa: E731
        print(f"{k:8} {len(group):6d} {mean('device'):9.2f} {mean('idle'):8.2f} {mean('plan_wait'):9.2f} "
              f"{mean('to_launch'):9.2f} {1000 * statistics.mean(turn) if turn else float('nan'):10.2f} "
              f"{sum(g['idle'] for g in group):7.2f}")


def print_starts(steps: list[dict]) -> None:
    ms = lambda v: "-" if v is None else f"{1000 * v:.2f}"  # noqa: E731
    print(f"\n{'step':>6} {'prefill tok':>11} {'decode':>6} {'to router':>9} {'to worker':>9} {'enqueue':>8} "
          f"{'device':>8} {'forward':>8} {'sent→back':>9}  (ms)")
    for r in steps:
        if "arrival_lag" not in r:
            continue
        to_worker = r["started"] - r["sent"] if "started" in r else None
        print(f"{r['step']:6d} {r['prefill_tokens']:11d} {r['decode']:6d} {ms(r['arrival_lag']):>9} {ms(to_worker):>9} "
              f"{ms(r.get('launch_s')):>8} {ms(r.get('device_s')):>8} {ms(r['forward_s']):>8} "
              f"{ms(r['returned'] - r['sent']):>9}")


if __name__ == "__main__":
    sys.exit(main())
