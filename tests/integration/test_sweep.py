"""Benchmark sweeps as a user runs them: `llaunch -m bench=... a=1,2 b=3,4` serves every job's config in
its own server subprocess, benchmarks it and stops it; `scripts/sweep_report.py` turns the sweep into a
table and a plot. Failing jobs are recorded and counted in the exit status."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import yaml

from fixtures.tiny_models import smollm2_dir
from integration.server import REPO, port_is_free
from llaunch.runtime.bootstrap import load_run_config

pytestmark = pytest.mark.timeout(900)

TINY = ["model=tiny-qwen2", "device=cpu", "model.dtype=float32", "cache.max_total_tokens=8192"]
BENCH = ["bench=c1", "bench.num_prompts=3", "bench.input_len=16", "bench.output_len=6", "bench.warmup=1"]


def llaunch(cwd: Path, *args: str, env: dict | None = None, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llaunch.launcher.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, COLUMNS="200", **(env or {})))


def sweep_report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "sweep_report.py"), *args], capture_output=True,
                          text=True, timeout=60)


def status_of(job_dir: Path) -> dict:
    return json.loads((job_dir / "status.json").read_text())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module", autouse=True)
def tokenizer_present():
    assert smollm2_dir().joinpath("tokenizer.json").exists(), "run `make setup` (scripts/prepare_models.py) first"


def test_two_by_two_sweep_benchmarks_every_job_and_reports(tmp_path):
    sweep = tmp_path / "sweep"
    r = llaunch(tmp_path, "-m", *BENCH, *TINY, "router.max_running_requests=4,8", "bench.concurrency=1,2",
                "bench.repeats=2", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    expected = [(4, 1), (4, 2), (8, 1), (8, 2)]  # Hydra's order: the first swept key varies slowest
    results = []
    for num, (rows, concurrency) in enumerate(expected):
        job = sweep / str(num)
        status = status_of(job)
        assert status["status"] == "ok", status["reason"]
        bench = json.loads((job / "bench.json").read_text())
        assert (bench["completed"], bench["failed"], bench["total_output_tokens"]) == (3, 0, 3 * 6)
        assert (bench["args"]["concurrency"], bench["args"]["input_len"]) == (concurrency, 16)
        # two runs on one server, the second on prompts the first never sent; the slowest is the headline
        assert bench["repeats"] == 2 and [run["prefix_cache_hit_rate"] for run in bench["runs"]] == [0.0, 0.0]
        assert bench["output_throughput"] == min(run["output_throughput"] for run in bench["runs"])
        resolved = load_run_config(str(job / "config.yaml"))  # the server's own resolved config
        assert resolved.router.max_running_requests == rows and resolved.bench is None
        assert resolved.server.port == int(status["http_url"].rsplit(":", 1)[1])
        # stopped by SIGTERM (drained, exit 0), gone, and its port free before the next job started
        assert status["server_exit_code"] == 0 and not pid_alive(status["server_pid"])
        assert port_is_free(resolved.server.port)
        assert "draining" in (job / "server.log").read_text()
        results.append(bench)
    assert len({b["args"]["base_url"] for b in results}) == 4  # every job had its own server

    rep = sweep_report(str(sweep))
    assert rep.returncode == 0, rep.stderr
    assert "router.max_running_requests" in rep.stdout and "output tok/s" in rep.stdout
    lines = (sweep / "report.md").read_text().splitlines()
    table = [line for line in lines if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[:7] == ["router.max_running_requests", "bench.concurrency", "req/s", "output tok/s",
                          "TTFT median (ms)", "TTFT p95 (ms)", "TTFT p99 (ms)"] and header[-1] == "errors"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [(int(row[0]), int(row[1])) for row in rows] == expected
    for row, bench in zip(rows, results):  # the figures are bench.json's (then the two runs' range)
        assert float(row[3].split()[0]) == pytest.approx(bench["output_throughput"], abs=0.051)
        assert float(row[6].split()[0]) == pytest.approx(bench["p99_ttft_ms"], abs=0.051)
    png = sweep / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 200 and image.std() > 0


def test_failing_jobs_are_recorded_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    # job 0 crashes (192.0.2.1 is a documentation address no host owns); job 1 breaks a rule
    r = llaunch(tmp_path, "-m", *BENCH, *TINY, "server.host=192.0.2.1", "server.http_workers=1,0",
                f"hydra.sweep.dir={sweep}")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]  # the number of failed jobs
    crashed, invalid = status_of(sweep / "0"), status_of(sweep / "1")
    assert crashed["status"] == "failed" and "exit code 1" in crashed["reason"]
    assert "Cannot assign requested address" in crashed["reason"]
    assert invalid["status"] == "failed" and "invalid configuration" in invalid["reason"]
    assert "server.http_workers=0" in invalid["reason"]
    assert not (sweep / "0" / "bench.json").exists()
    rep = sweep_report(str(sweep))
    assert rep.returncode == 1  # nothing to tabulate
    report = (sweep / "report.md").read_text()
    assert "Failed jobs" in report and "server.http_workers=0" in report


def test_a_single_bench_job_times_out_and_stops_its_server(tmp_path):
    run_dir = tmp_path / "run"
    r = llaunch(tmp_path, *BENCH, *TINY, "bench.ready_timeout_s=0", f"hydra.run.dir={run_dir}")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    status = status_of(run_dir)
    assert status["status"] == "failed" and "within 0 s" in status["reason"]
    assert "bench.ready_timeout_s" in status["reason"]
    assert not pid_alive(status["server_pid"])
    assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) == [*BENCH, *TINY, "bench.ready_timeout_s=0"]


def test_the_readmes_sweep_runs_on_this_machine(tmp_path):
    """The README's sweep line, as written, on the default model: every job benchmarks and reports."""
    readme = (REPO / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith(".venv/bin/llaunch -m bench=smoke"))
    args = line.split("#")[0].split()[1:]
    sweep = tmp_path / "sweep"
    r = llaunch(tmp_path, *args, "device=cpu", f"hydra.sweep.dir={sweep}", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2
    for job in jobs:
        bench = json.loads((job / "bench.json").read_text())
        assert status_of(job)["status"] == "ok" and bench["completed"] == 8 and bench["failed"] == 0


def test_a_sweep_under_submitit_runs_every_job(tmp_path):
    """hydra/launcher=submitit_local: each job a submitit process (side by side); the Slurm profile
    (conf/hydra/launcher/slurm.yaml) composes to submitit's SlurmLauncher."""
    sweep = tmp_path / "sweep"
    r = llaunch(tmp_path, "-m", "hydra/launcher=submitit_local", *BENCH, *TINY, "router.max_running_requests=4,8",
                f"hydra.sweep.dir={sweep}", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for job in (sweep / "0", sweep / "1"):
        assert status_of(job)["status"] == "ok" and json.loads((job / "bench.json").read_text())["completed"] == 3
    assert (sweep / ".submitit").is_dir()
    cfg = llaunch(tmp_path, "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "bench=c64", "--cfg", "hydra")
    launcher = yaml.safe_load(cfg.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher") and launcher["partition"] == "gpu"
