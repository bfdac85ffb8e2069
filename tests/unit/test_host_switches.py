"""How the graph runs on its host: the MPS daemon's start and stop, the /dev/shm warning, tcp endpoints
on one node, and which decode steps replay a CUDA graph under model.graph_max_len_in_batch."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from llaunch.launcher import host_checks, mps, plan, rules_graph
from llaunch.runtime.config import Device, LlaunchConfig, ParallelConfig, ZmqMode

FAKE_CONTROL = """#!/bin/sh
# records how it was called and what it read on stdin, as nvidia-cuda-mps-control would act on it
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=$(cat)" >> "$MPS_RECORD"
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    binary = bin_dir / mps.CONTROL
    binary.write_text(FAKE_CONTROL)
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "record"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MPS_RECORD", str(record))
    return record


def test_mps_daemon_starts_in_a_private_directory_and_quits(fake_control):
    daemon = mps.MpsDaemon()
    daemon.start()
    pipe, log = daemon.env["CUDA_MPS_PIPE_DIRECTORY"], daemon.env["CUDA_MPS_LOG_DIRECTORY"]
    assert os.path.isdir(pipe) and os.path.isdir(log) and len(pipe) < 80  # a unix socket's path lives there
    base = daemon.base
    daemon.stop()
    daemon.stop()  # once only
    assert not os.path.exists(base)
    assert fake_control.read_text().splitlines() == [
        f"args=-d pipe={pipe} log={log} stdin=",  # -d: fork the control daemon
        f"args= pipe={pipe} log={log} stdin=quit",  # quit on its control pipe
    ]


def test_a_daemon_that_fails_to_start_is_a_named_error(fake_control, tmp_path):
    binary = tmp_path / "bin" / mps.CONTROL
    binary.write_text("#!/bin/sh\necho 'MPS not supported' >&2\nexit 1\n")
    daemon = mps.MpsDaemon()
    with pytest.raises(mps.MpsError, match="nvidia-cuda-mps-control -d failed"):
        daemon.start()
    assert daemon.base is None


def test_supervised_gpu_processes_get_the_daemon_environment(fake_control, tmp_path):
    """The launcher starts the daemon before the first process and points GPU processes at it."""
    from llaunch.launcher import supervise
    from llaunch.runtime.config import ProcessGraph, ProcessSpec, RunConfig

    specs = [ProcessSpec(name="worker.0.0", role="worker", gpus=[0]), ProcessSpec(name="router.0", role="router")]
    cfg = RunConfig(parallel=ParallelConfig(cuda_mps=True), run_dir=str(tmp_path),
                    graph=ProcessGraph(processes=specs, http_url="", ipc_dir="", control=""))
    graph = supervise.Graph(cfg, tmp_path / "config.yaml")
    seen = {}

    real = subprocess.Popen

    def popen(argv, *args, **kw):
        if "--name" not in argv:  # the daemon's control command: run it
            return real(argv, *args, **kw)
        seen[argv[argv.index("--name") + 1]] = kw["env"]
        return SimpleNamespace(poll=lambda: None)

    supervise.subprocess.Popen = popen
    try:
        graph.start(None)
    finally:
        supervise.subprocess.Popen = real
    assert fake_control.read_text().startswith("args=-d ")
    assert seen["worker.0.0"]["CUDA_MPS_PIPE_DIRECTORY"] == graph.mps.env["CUDA_MPS_PIPE_DIRECTORY"]
    graph.mps.stop()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in seen["router.0"]  # no CUDA context there


def test_mps_rule_needs_the_control_binary(monkeypatch):
    cfg = LlaunchConfig(parallel=ParallelConfig(cuda_mps=True), device=Device.cuda)
    monkeypatch.setattr(mps, "control_binary", lambda: None)
    [violation] = rules_graph.cuda_mps_daemon_installed(cfg)
    assert mps.CONTROL in violation.message and "parallel.cuda_mps" in violation.message
    monkeypatch.setattr(mps, "control_binary", lambda: "/usr/bin/" + mps.CONTROL)
    assert rules_graph.cuda_mps_daemon_installed(cfg) == []


def _statvfs(size: int):
    return lambda path: SimpleNamespace(f_blocks=size // 4096, f_frsize=4096)


def test_shm_warning_for_several_ranks_on_a_small_dev_shm():
    tp2 = LlaunchConfig(parallel=ParallelConfig(tp=2))
    docker_default = _statvfs(64 << 20)
    message = host_checks.shm_warning(tp2, statvfs=docker_default)
    assert "64 MiB" in message and "--shm-size" in message and "parallel.shm_warning=false" in message
    assert host_checks.shm_warning(tp2, statvfs=_statvfs(8 << 30)) is None  # big enough
    assert host_checks.shm_warning(LlaunchConfig(), statvfs=docker_default) is None  # one rank: no collectives
    silenced = LlaunchConfig(parallel=ParallelConfig(tp=2, shm_warning=False))
    assert host_checks.shm_warning(silenced, statvfs=docker_default) is None


def test_the_launcher_prints_the_shm_warning(tmp_path):
    """Through the real command on this machine: the warning shows when /dev/shm is under 1 GiB."""
    small = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize < host_checks.SHM_MIN_BYTES
    out = subprocess.run([sys.executable, "-m", "llaunch.launcher.main", "model=tiny-llama", "device=cpu",
                          "parallel=tp2", "dry_run=true"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("/dev/shm holds" in out.stderr) == small


def test_tcp_mode_plans_loopback_ports_and_no_ipc_dir():
    cfg = LlaunchConfig(parallel=ParallelConfig(zmq_mode=ZmqMode.tcp, dp=2))
    cfg = replace(cfg, server=replace(cfg.server, port=18000))
    with plan.endpoints_for(cfg) as endpoints:
        graph = plan.plan_graph(cfg, endpoints)
    addresses = [a for spec in graph.processes for a in (*spec.binds.values(), *spec.connects.values())]
    assert addresses and all(a.startswith("tcp://") for a in addresses), addresses
    ports = [spec.binds for spec in graph.processes]
    bound = [a for b in ports for a in b.values()]
    assert len(bound) == len(set(bound))  # each endpoint its own port
    assert graph.ipc_dir == "" and plan.unmatched_connects(graph) == []


def test_decode_graphs_replay_only_within_graph_max_len():
    from llaunch.runtime.worker.cuda_graphs import DecodeGraphs

    graphs = SimpleNamespace(buckets=[1, 2, 4, 8], max_model_len=256)
    fits = DecodeGraphs.fits
    assert fits(graphs, 8, 256) and not fits(graphs, 8, 257)  # one row past the bound: eager
    assert not fits(graphs, 9, 10) and not fits(graphs, 0, 10)
