"""The worker's profiler (POST /start_profile, /stop_profile) on a GPU: the kernels launched between a start and a stop,
eager and from a CUDA graph's replay as the decode steps run, are in its trace and lead its table by device time
(tests/integration/test_profile_routes.py holds the routes on a CPU server)."""
from __future__ import annotations

import gzip
import json

import torch

from llaunch.kernels import dispatch
from llaunch.runtime.ipc.messages import Profile
from llaunch.runtime.worker.step_profiler import StepProfiler


def test_a_profile_holds_the_kernels_of_eager_launches_and_graph_replays(tmp_path):
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    dispatch.rmsnorm(x, w, 1e-6)  # compiled before the profile
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a @ a
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b = a @ a
    profiler = StepProfiler(str(tmp_path), "worker-0-0", cuda=True)
    profiler.handle(Profile(start=True))
    dispatch.rmsnorm(x, w, 1e-6)
    for _ in range(3):
        graph.replay()
    profiler.stop()
    assert b.shape == (2048, 2048)
    trace_path, table_path = profiler.written
    assert trace_path.name == "worker-0-0-1.trace.json.gz" and table_path.name == "worker-0-0-1.kernels.txt"
    events = json.loads(gzip.decompress(trace_path.read_bytes()))["traceEvents"]
    kernels = [e["name"] for e in events if e.get("cat") == "kernel"]
    assert any("rmsnorm" in name for name in kernels), sorted(set(kernels))
    assert sum("gemm" in name.lower() or "nvjet" in name or "cutlass" in name for name in kernels) >= 3  # each replay
    table = table_path.read_text()
    assert "Self CUDA" in table or "Self Device" in table  # sorted by the device's time on a GPU worker
