"""The router's step trace splits a new request's time to first token: the report's --starts line
shows frontend → router, router → worker, host enqueue and device time from what was recorded."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan, StepResult
from llaunch.runtime.router.step_trace import StepTrace

REPORT = Path(__file__).resolve().parents[2] / "scripts" / "step_trace_report.py"


def _prefill_plan(step: int) -> StepPlan:
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
    return StepPlan(step=step, new=[NewSeq(row=0, request_id="r", sampling=sampling, prompt_ids=[5] * 7)],
                    prefill=[PrefillChunk(row=0, token_ids=[5] * 7, start=0, slots=list(range(7)), sample=True)])


def test_a_traced_prefill_records_each_part_of_its_latency(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))
    assert trace.enabled and not StepTrace(None).enabled
    arrived = time.time() - 0.004  # the frontend stamped the request 4 ms before it was planned
    trace.planned(_prefill_plan(0), running=1, waiting=0, arrivals=(arrived, arrived + 0.001))
    sent = json.loads(json.dumps(trace._open[0]))["sent"]
    trace.returned(StepResult(step=0, rows=[0], token_ids=[9], forward_s=0.0151, started=sent + 0.0003,
                              launch_s=0.0025, device_s=0.0142))
    trace.planned(StepPlan(step=1, decode_rows=[0], decode_slots=[7]), running=1, waiting=0)
    trace.returned(StepResult(step=1, rows=[0], token_ids=[3], forward_s=0.004))  # an untimed worker
    trace.close()

    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert 0.004 <= first["arrival_lag"] < 1.0  # the oldest new request's wait counts
    assert (first["launch_s"], first["device_s"]) == (0.0025, 0.0142)
    assert abs(first["started"] - first["sent"] - 0.0003) < 1e-9
    assert "arrival_lag" not in second and "device_s" not in second

    out = subprocess.run([sys.executable, str(REPORT), str(path), "--bins", "1", "--starts"], capture_output=True,
                         text=True, check=True).stdout
    lines = [line.split() for line in out.splitlines() if line.split()[:2] == ["0", "7"]]
    assert len(lines) == 1, out  # one line: the step that started the request
    to_router, to_worker, enqueue, device, forward = lines[0][3:8]
    assert float(to_router) >= 4.0
    assert (to_worker, enqueue, device, forward) == ("0.30", "2.50", "14.20", "15.10")
