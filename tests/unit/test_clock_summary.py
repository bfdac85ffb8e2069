"""scripts/clock_summary.py reads what `nvidia-smi --query-gpu=... -lms` wrote during a benchmark run and says
whether the card held its clock: the SM clock's median and low, the power, and the slowdown reasons by share."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "clock_summary.py"

# four samples as nvidia-smi 580 writes them (csv,noheader,nounits), one with a field it could not read
SAMPLES = """1980, 2619, 412.50, 55, 0x0000000000000000
1755, 2619, 699.80, 66, 0x0000000000000004
1710, 2619, 700.10, 68, 0x000000000000000C
[N/A], 2619, 698.00, 67, 0x0000000000000004
"""


def _summary(tmp_path, text: str) -> str:
    path = tmp_path / "clocks.csv"
    path.write_text(text)
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_power_capped_run_shows_its_clock_drop_and_why(tmp_path):
    line = _summary(tmp_path, SAMPLES)
    assert line.startswith("clocks: 4 samples")
    assert "SM MHz median 1755 (min 1710, max 1980)" in line  # the unreadable sample is left out
    assert "power W median 699 (max 700)" in line and "temp max 68 C" in line
    assert line.endswith("reasons: power cap 75%, hw slowdown 25%")


def test_a_run_without_samples_says_so(tmp_path):
    assert _summary(tmp_path, "") == "clocks: no samples"
    assert _summary(tmp_path, "1980, 2619, 300.0, 50, 0x0\n").endswith("reasons: none")


def test_sampling_runs_nvidia_smi_with_the_columns_it_reads_and_stops_when_killed(tmp_path):
    import os
    import time

    fake = tmp_path / "bin" / "nvidia-smi"  # prints its arguments once, then a sample every 50 ms
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$*" > "$(dirname "$0")/args"\n'
                    'while true; do echo "1500, 2619, 650.0, 70, 0x4"; sleep 0.05; done\n')
    fake.chmod(0o755)
    out = tmp_path / "sampled.csv"
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    sampler = subprocess.Popen([sys.executable, str(SCRIPT), "--sample", str(out)], env=env)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 2):
        time.sleep(0.05)
    sampler.kill()
    sampler.wait(timeout=5)
    args = (fake.parent / "args").read_text()
    assert "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active" in args
    assert _summary(tmp_path, out.read_text()).endswith("reasons: power cap 100%")
