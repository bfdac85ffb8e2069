"""The pure parts of a benchmark job (launcher/bench_job.py, bench_server.py) and its progress display: the server's
overrides, GPU shares, the bench command line (parsed back by scripts/bench_serving.py itself), and
the sweep's size as Hydra's sweeper counts it."""
from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from rich.console import Console

from llaunch.launcher import bench_job, bench_server
from llaunch.runtime.config import BenchConfig, BenchLengths, ModelConfig, ProcessGraph, RunConfig, ServerConfig
from llaunch.launcher.sweep_progress import SweepProgress, SweepShape, sweep_shape



def test_server_overrides_drop_the_bench_and_keep_or_pick_a_port():
    job = ["bench=c64", "bench.concurrency=8", "+bench.extra=1", "model=qwen2-7b",
           "router.max_running_requests=64", "server.http_workers=2", "~cache.max_total_tokens"]
    assert bench_server.server_overrides(job) == ["model=qwen2-7b", "router.max_running_requests=64",
                                               "server.http_workers=2", "~cache.max_total_tokens", "server.port=0"]
    assert bench_server.server_overrides([*job, "server.port=8123"])[-1] == "server.port=8123"  # the user's


@pytest.mark.parametrize("num,per_job,visible,expected", [
    (0, 2, ["0", "1", "2", "3"], ["0", "1"]),
    (1, 2, ["0", "1", "2", "3"], ["2", "3"]),
    (2, 2, ["0", "1", "2", "3"], ["0", "1"]),  # wraps: at most GPUs / GPUs-per-job jobs side by side
    (3, 1, ["4", "6", "7"], ["4"]),  # the host's own CUDA_VISIBLE_DEVICES is honoured
    (1, 4, ["0", "1", "2", "3", "4", "5", "6", "7"], ["4", "5", "6", "7"]),
])
def test_each_parallel_job_gets_its_own_gpus(num, per_job, visible, expected):
    assert bench_job.job_gpus(num, per_job, visible) == expected


def test_a_job_larger_than_the_host_fails_with_the_counts():
    with pytest.raises(bench_job.JobFailed, match="needs 8 GPUs.*4 visible"):
        bench_job.job_gpus(0, 8, ["0", "1", "2", "3"])


def test_bench_command_carries_the_profile_to_bench_serving(bench, tmp_path, monkeypatch):
    cfg = RunConfig(model=ModelConfig(name="tiny", vocab_size=49152), server=ServerConfig(api_key="k"),
                    graph=ProcessGraph(processes=[], http_url="http://127.0.0.1:4321", ipc_dir="", control=""))
    profile = BenchConfig(num_prompts=7, input_len=33, output_len=9, concurrency=3, request_rate=float("inf"),
                          warmup=2)
    cmd = bench_job.bench_command(profile, cfg, tmp_path / "bench.json")
    assert cmd[0] == sys.executable and Path(cmd[1]).name == "bench_serving.py" and Path(cmd[1]).exists()
    assert not [a for a in cmd if "api-key" in a]  # a secret stays off the command line (ps)
    monkeypatch.setenv(bench_job.API_KEY_VARIABLE, "k")  # run_bench hands it over in the environment
    args = bench.parse_args(cmd[2:])
    assert (args.base_url, args.model, args.vocab_size, args.api_key) == ("http://127.0.0.1:4321", "tiny", 49152, "k")
    assert (args.num_prompts, args.input_len, args.output_len, args.concurrency, args.warmup) == (7, 33, 9, 3, 2)
    assert math.isinf(args.request_rate) and args.result_file == str(tmp_path / "bench.json")
    finite = bench_job.bench_command(BenchConfig(request_rate=2.5), cfg, tmp_path / "b.json")
    assert bench.parse_args(finite[2:]).request_rate == 2.5
    plain = bench.parse_args(cmd[2:])
    assert (plain.shared_prefix_groups, plain.shared_prefix_len, plain.multi_turn, plain.client_procs) == (0, 0, 1, 1)
    procs = bench_job.bench_command(BenchConfig(client_procs=4, concurrency=8), cfg, tmp_path / "p.json")
    assert bench.parse_args(procs[2:]).client_procs == 4
    shared = BenchConfig(shared_prefix_groups=4, shared_prefix_len=2048, multi_turn=3)
    args = bench.parse_args(bench_job.bench_command(shared, cfg, tmp_path / "s.json")[2:])
    assert (args.shared_prefix_groups, args.shared_prefix_len, args.multi_turn) == (4, 2048, 3)


@pytest.mark.parametrize("overrides", [
    ["bench=c1", "router.max_running_requests=4,8", "bench.concurrency=1,2"],
    ["parallel=tp1,tp2,tp4", "model=qwen2-7b", "router.max_running_requests=range(64,512,64)"],
    ["bench=c1"],
])
def test_sweep_shape_counts_jobs_as_hydras_sweeper_does(overrides):
    parsed = OverridesParser.create().parse_overrides(overrides)
    jobs = BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]
    shape = sweep_shape(overrides)
    assert shape.size == len(jobs)
    assert list(shape.keys) == [o.split("=")[0] for o in overrides if "," in o or "range(" in o]


def test_progress_prints_one_line_per_job_and_the_sweep_total():
    buffer = io.StringIO()
    progress = SweepProgress(SweepShape(2, ("bench.concurrency",)), Console(file=buffer, width=200))
    task = progress.start_job(0, ["bench=c1", "bench.concurrency=1"], bench_job.STAGES)
    progress.advance(task)
    progress.finish_job(task, {"status": "ok", "output_throughput": 123.45, "p99_ttft_ms": 6.78})
    task = progress.start_job(1, ["bench=c1", "bench.concurrency=2"], bench_job.STAGES)
    progress.finish_job(task, {"status": "failed", "reason": "the server exited (exit code 1)"})
    text = buffer.getvalue()
    assert "job 0 bench.concurrency=1: 123.5 output tok/s, TTFT p99 6.8 ms" in text
    assert "job 1 bench.concurrency=2: the server exited (exit code 1)" in text
    assert "sweep done: 2 jobs, 1 failed" in text and "bench=c1" not in text  # only what the sweep varies


def test_bench_command_carries_the_trace_and_the_length_distribution(bench, tmp_path, monkeypatch):
    cfg = RunConfig(model=ModelConfig(name="tiny", vocab_size=49152, max_model_len=2048),
                    graph=ProcessGraph(processes=[], http_url="http://127.0.0.1:4321", ipc_dir="", control=""))
    monkeypatch.chdir(tmp_path)  # a relative trace is the sweep's working directory's
    traced = bench.parse_args(bench_job.bench_command(BenchConfig(trace="t.jsonl"), cfg, tmp_path / "b.json")[2:])
    assert (traced.trace, traced.lengths, traced.max_model_len) == (str(tmp_path / "t.jsonl"), "fixed", None)
    drawn = BenchConfig(lengths=BenchLengths.sharegpt)
    args = bench.parse_args(bench_job.bench_command(drawn, cfg, tmp_path / "b.json")[2:])
    assert (args.trace, args.lengths, args.max_model_len) == (None, "sharegpt", 2048)
