"""One line on the GPU's clocks over a benchmark run, from the samples `nvidia-smi -lms` wrote (gpu_run.sh's run_case):
whether the SM clock held or the card slowed for power or heat while the run was timed. A served step that takes
longer than the same step profiled alone (bf16 c256's mixed step, 51.7 ms served vs 41.5 ms in profile_kernels.py,
H100, 2026-12-05) is either the software's or the clock's; this line says which.

    python scripts/clock_summary.py --sample clocks.csv &   (nvidia-smi's samples every 250 ms until killed)
    python scripts/clock_summary.py clocks.csv              (the line)
"""

from __future__ import annotations

import os
import statistics
import sys

# the columns nvidia-smi writes (csv,noheader,nounits) and summarize reads, in this order
FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")

# nvidia-smi's clock event reasons (nvml's nvmlClocksEventReason*): why the clock is below its maximum
REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "power cap", 0x8: "hw slowdown", 0x10: "sync boost",
           0x20: "sw thermal", 0x40: "hw thermal", 0x80: "power brake", 0x100: "display clocks"}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def summarize(lines: list[str]) -> str:
    rows = [[c.strip() for c in line.split(",")] for line in lines if line.count(",") >= 4]
    if not rows:
        return "clocks: no samples"
    sm = [v for v in (_number(r[0]) for r in rows) if v is not None]
    power = [v for v in (_number(r[2]) for r in rows) if v is not None]
    temp = [v for v in (_number(r[3]) for r in rows) if v is not None]
    seen: dict[str, int] = {}  # reason -> samples it was active in
    for r in rows:
        try:
            bits = int(r[4], 16)
        except ValueError:
            continue
        for bit, name in REASONS.items():
            if bits & bit:
                seen[name] = seen.get(name, 0) + 1
    parts = [f"clocks: {len(rows)} samples"]
    if sm:
        parts.append(f"SM MHz median {statistics.median(sm):.0f} (min {min(sm):.0f}, max {max(sm):.0f})")
    if power:
        parts.append(f"power W median {statistics.median(power):.0f} (max {max(power):.0f})")
    if temp:
        parts.append(f"temp max {max(temp):.0f} C")
    parts.append("reasons: " + (", ".join(f"{k} {100 * v / len(rows):.0f}%" for k, v in
                                          sorted(seen.items(), key=lambda kv: -kv[1])) or "none"))
    return "; ".join(parts)


def sample(path: str) -> None:
    """Become nvidia-smi writing FIELDS to `path` every 250 ms (exec: killing this process stops it)."""
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.execvp("nvidia-smi", ["nvidia-smi", "--query-gpu=" + ",".join(FIELDS), "--format=csv,noheader,nounits",
                             "-lms", "250"])


def main() -> None:
    if sys.argv[1] == "--sample":
        sample(sys.argv[2])
    with open(sys.argv[1]) as f:
        print(summarize(f.read().splitlines()))


if __name__ == "__main__":
    main()
