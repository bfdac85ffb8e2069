"""Start a real `llaunch` process graph for a test and stop it cleanly."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

REPO = Path(__file__).resolve().parents[2]


_handed_out: set[int] = set()


def metric_samples(url: str, name: str) -> dict[tuple, float]:
    """A server's `llaunch:<name>` samples from /metrics, parsed as Prometheus text (label order and
    number format are the client library's business), keyed by their sorted label pairs."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "llaunch:" + name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def free_port() -> int:
    """A port free now and not handed out before in this test run: a port given to one server but not
    yet bound is free to the OS, which may offer it again (a PD deployment once got its master's
    register port as another server's HTTP port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class LlaunchServer:
    def __init__(self, overrides: list[str], run_dir: Path, env: Optional[dict] = None, ready_timeout: float = 600,
                 port_key: str = "server.port"):
        """`port_key`: the key of the port /health is served on (a config server's: mode.config_server_port)."""
        self.port = free_port()
        self.run_dir = run_dir
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "llaunch.launcher.main", *overrides, f"{port_key}={self.port}",
               f"hydra.run.dir={run_dir}"]
        self.log_path = run_dir.parent / f"{run_dir.name}-launcher.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        full_env = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self.ready_timeout = ready_timeout

    def wait_healthy(self) -> "LlaunchServer":
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llaunch exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop(signal.SIGINT)
        raise TimeoutError(f"llaunch not healthy after {self.ready_timeout}s:\n{self.output()}")

    def output(self) -> str:
        if not self._log.closed:  # stop() closes it: a timed-out start reports its log after stopping
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def children(self) -> list[int]:
        """Pids of the graph's processes (their parent is the launcher)."""
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[1]) == self.proc.pid and fields[0] != "Z":
                    out.append(int(entry.name))
        return out

    def stop(self, sig=signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self.wait_healthy()

    def __exit__(self, *exc):
        self.stop()
