"""scripts/tune_moe.py --cpu: the MoE launch sweep runs end to end in Triton's interpreter (compiling workers, each
candidate checked against the reference, timed, the winners written) and prints a kernels.moe_shapes value that
parses and names the tiny layer shape it tuned."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llaunch.kernels.settings import MoeLaunch, parse_moe_shapes

pytestmark = pytest.mark.slow  # seconds: `make test` runs it, `make test-fast` does not

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tune_moe.py"


def test_cpu_smoke_prints_parsable_moe_shapes(tmp_path):
    out = tmp_path / "moe_shapes.txt"
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [row["tokens"] for row in rows] == [1, 4]
    assert all(row["candidates"] == 2 and row["skipped"] == 0 and row["untried"] == 0 and row["best"] for row in rows)
    [text] = [line.removeprefix("moe_shapes: ") for line in lines if line.startswith("moe_shapes: ")]
    shapes = parse_moe_shapes(text)
    assert list(shapes) == [(8, 32, 64)]
    bounds = [bound for bound, _ in shapes[(8, 32, 64)]]
    assert bounds[-1] is None and all(isinstance(launch, MoeLaunch) for _, launch in shapes[(8, 32, 64)])
    assert out.read_text().strip() == text
