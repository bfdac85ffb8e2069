"""The wheel runs outside the checkout, as the container images install it (docker/Dockerfile*): build it
from what the images copy, install it into a fresh virtual environment, and from another directory run
`llaunch --help`, a dry run and a CPU serve of a tiny model answering a completion. The profiles (conf/)
travel in the wheel as package data; issue #42's wheel exited 2 with 'Primary config directory not found'.

The fresh environment sees this one's site-packages through a .pth line (the dependencies: torch and
the rest are not downloaded again) but not its editable finder, so `llaunch` imports only from the
wheel; pip installs with --no-index, so the wheel's requirements must be met by what is installed."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

from integration.server import REPO, free_port

pytestmark = pytest.mark.timeout(600)


def _run(cmd, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ folder of a fresh environment with the wheel built from this checkout installed."""
    root = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    src = root / "src"  # what the images copy into their build stage, and nothing else
    for line in (REPO / "docker" / "Dockerfile.cpu").read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            path = line.split()[1]
            if (REPO / path).is_dir():
                shutil.copytree(REPO / path, src / path, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                src.mkdir(exist_ok=True)
                shutil.copy(REPO / path, src / path)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", root / "dist",
                  src], cwd=root, env=env)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel, = (root / "dist").glob("llaunch-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root, env=env).check_returncode()
    site, = venv.glob("lib/python*/site-packages")
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = _run([venv / "bin" / "python", "-m", "pip", "install", "--no-index", "--no-compile", wheel],
               cwd=root, env=env)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-3000:]
    where = _run([venv / "bin" / "python", "-c", "import llaunch.launcher as l; print(l.__file__)"], cwd=root, env=env)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr  # the wheel's copy, not the checkout
    return venv / "bin"


@pytest.fixture
def elsewhere(tmp_path) -> dict:
    """The environment of a run outside the checkout (cwd: tmp_path)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"COLUMNS": "200"}


def test_help_and_dry_run_from_the_installed_wheel(installed, tmp_path, elsewhere):
    help_ = _run([installed / "llaunch", "--help"], cwd=tmp_path, env=elsewhere, timeout=100)
    assert help_.returncode == 0, help_.stderr
    assert "  model: " in help_.stdout and "smollm2-135m" in help_.stdout
    assert "  parallel: dp2, tp1, tp2" in help_.stdout
    dry = _run([installed / "llaunch", "dry_run=true", "parallel=dp2", "device=cpu"], cwd=tmp_path, env=elsewhere,
               timeout=100)
    assert dry.returncode == 0, dry.stderr
    assert "worker.1.0" in dry.stdout and "Primary config directory" not in dry.stderr


def test_a_cpu_serve_from_the_installed_wheel_answers_a_completion(installed, tmp_path, elsewhere, tiny_dirs):
    """Also: server.metrics_prefix=vllm reaches /metrics, in OpenMetrics for Prometheus' Accept header."""
    port = free_port()
    cmd = [installed / "llaunch", "device=cpu", "model=llama", f"model.path={tiny_dirs['llama']}",
           "model.name=tiny", "model.dtype=float32", "cache.max_total_tokens=4096", "router.max_running_requests=8",
           "server.metrics_prefix=vllm", f"server.port={port}", f"hydra.run.dir={tmp_path / 'run'}"]
    log = (tmp_path / "llaunch.log").open("wb")
    proc = subprocess.Popen([str(c) for c in cmd], cwd=tmp_path, env=elsewhere, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "llaunch.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "not ready in 300 s:\n" + (tmp_path / "llaunch.log").read_text()[-4000:]
            try:
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "The capital of France is",
                                                       "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        metrics = httpx.get(url + "/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0"})
        assert metrics.headers["content-type"].startswith("application/openmetrics-text")
        assert 'vllm:generation_tokens_total{model_name="tiny"}' in metrics.text and "llaunch:" not in metrics.text
    finally:
        proc.send_signal(signal.SIGTERM)  # a container's stop: drain, then exit 0
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
    assert code == 0, (tmp_path / "llaunch.log").read_text()[-4000:]
