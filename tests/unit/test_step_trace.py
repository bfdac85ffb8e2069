"""The router's step trace splits a new request's time to first token: the report's --starts line
shows frontend → router, router → worker, host enqueue and device time from what was recorded."""
from __future__ import annotations

import gzip
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


def test_the_pipeline_report_splits_the_device_idle_between_steps_by_cause(tmp_path):
    # step 0 runs on the device 0.100-0.110; step 1's plan is sent at 0.104 but launched at 0.113
    # (3 ms after the device ran dry: the worker's side); step 2's plan is sent at 0.128, 8 ms after
    # step 1's device end at 0.120 (the router's side), launched at 0.129
    rows = [dict(step=0, sent=0.099, returned=0.111, started=0.100, launch_s=0.0005, device_s=0.010),
            dict(step=1, sent=0.104, returned=0.121, started=0.113, launch_s=0.0005, device_s=0.007),
            dict(step=2, sent=0.128, returned=0.140, started=0.129, launch_s=0.0005, device_s=0.010)]
    path = tmp_path / "trace.jsonl.gz"  # as gpu_run.sh brings a server's trace back
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(dict(r, decode=4, prefill_tokens=0, chunks=0, new=0, running=4, waiting=0,
                                        forward_s=0.01)) + "\n" for r in rows))
    out = subprocess.run([sys.executable, str(REPORT), str(path), "--bins", "1", "--pipeline"], capture_output=True,
                         text=True, check=True).stdout
    line = next(line.split() for line in out.splitlines()[out.splitlines().index(next(
        x for x in out.splitlines() if "plan wait" in x)):] if line.startswith("decode"))
    steps, device, idle, plan_wait, to_launch, turnaround, idle_s = line[1:8]
    assert steps == "3" and device == "9.00"
    assert idle == "4.00"  # (0 + 3 + 9) / 3 ms
    # step 2's 8 of its 9 idle ms waited for the plan; step 1's 3 were the worker's
    assert plan_wait == "2.67" and to_launch == "1.33"
    assert turnaround == "17.00"  # step 2 sent 17 ms after step 0's result came back
    assert idle_s == "0.01"


def test_verify_steps_are_their_own_kind(tmp_path):
    """Speculative decoding's verify chunks are recorded with their tokens, and the report times verify steps
    apart from decode steps (a verify step beside decode rows is a verify step; beside a prefill, mixed)."""
    from llaunch.runtime.ipc.messages import VerifyChunk

    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path))
    plans = [StepPlan(step=0, decode_rows=[1], decode_slots=[9]),
             StepPlan(step=1, decode_rows=[1], decode_slots=[10],
                      verify=[VerifyChunk(row=0, token_ids=[4, 5, 6], start=20, slots=[30, 31, 32])]),
             StepPlan(step=2, verify=[VerifyChunk(row=0, token_ids=[7, 8], start=23, slots=[33, 34])])]
    for plan in plans:
        trace.planned(plan, running=2, waiting=0)
        sent = trace._open[plan.step]["sent"]
        trace.returned(StepResult(step=plan.step, rows=[1], token_ids=[3], forward_s=0.002, started=sent,
                                  launch_s=0.0001, device_s=0.001 * (plan.step + 1)))
    trace.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["verify"], r["verify_tokens"]) for r in records] == [(0, 0), (1, 3), (1, 2)]
    out = subprocess.run([sys.executable, str(REPORT), str(path), "--bins", "1", "--pipeline"], capture_output=True,
                         text=True, check=True).stdout
    kinds, pipeline = out.split("\n\n")[0], out.split("\n\n")[-1]  # the kinds' table, the device's waits
    rows = {line.split()[0]: line.split() for line in kinds.splitlines()[2:]}
    assert set(rows) == {"decode", "verify"} and (rows["decode"][1], rows["verify"][1]) == ("1", "2")
    assert (rows["decode"][-1], rows["verify"][-1]) == ("0.0", "2.5")  # verify tokens a step
    waits = {line.split()[0]: line.split() for line in pipeline.splitlines()[1:]}
    assert (waits["decode"][2], waits["verify"][2]) == ("1.00", "2.50")  # device ms a step
