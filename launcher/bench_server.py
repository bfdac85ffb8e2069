"""The server of one benchmark job: `llaunch <job overrides minus bench>` (on server.port if the job sets
it, else any free port) as a subprocess in <job dir>/server (so no state leaks between the jobs of a
sweep), its output in <job dir>/server.log.

It learns its port from the run config the launcher writes before starting any process, waits for
/health, and stops with SIGTERM (drain) and waits until the port is free."""
from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import msgspec

from llaunch.runtime.config import RunConfig


class JobFailed(Exception):
    pass


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def server_overrides(overrides: list[str]) -> list[str]:
    """The job's overrides for its server: no bench keys; the port given, else any free one (read back
    from its config), so parallel jobs never collide by default."""
    kept = [o for o in overrides if override_key(o) != "bench" and not override_key(o).startswith("bench.")]
    return kept if any(override_key(o) == "server.port" for o in kept) else [*kept, "server.port=0"]


def die_with_parent() -> None:
    """Runs in a child before exec: SIGTERM (a drain) when the sweep process dies, so nothing is orphaned."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def wait_port_free(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not port_is_free(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class ServerProcess:
    def __init__(self, job_dir: Path, overrides: list[str], env: dict[str, str]):
        self.run_dir = job_dir / "server"
        self.log_path = job_dir / "server.log"
        (self.run_dir / "config.yaml").unlink(missing_ok=True)  # a stale one would name a dead port
        cmd = [sys.executable, "-m", "llaunch.launcher.main", *server_overrides(overrides),
               f"hydra.run.dir={self.run_dir}"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, preexec_fn=die_with_parent)

    def check_alive(self, when: str) -> None:
        if self.proc.poll() is not None:
            what = "invalid configuration" if self.proc.returncode == 2 else f"exit code {self.proc.returncode}"
            raise JobFailed(f"the server exited {when} ({what}):\n{tail(self.log_path)}")

    def wait_config(self, deadline: float, timeout_name: str) -> RunConfig:
        """The launcher writes the resolved config (with its chosen port) before it starts any process."""
        path = self.run_dir / "config.yaml"
        while True:
            try:
                return msgspec.yaml.decode(path.read_bytes(), type=RunConfig)
            except (OSError, msgspec.DecodeError):  # not there yet, or caught mid-write
                pass
            self.check_alive("before planning its graph")
            if time.monotonic() > deadline:
                raise JobFailed(f"the server wrote no {path} within {timeout_name}")
            time.sleep(0.1)

    def wait_healthy(self, url: str, deadline: float, timeout_name: str) -> None:
        while True:
            self.check_alive("before it was healthy")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise JobFailed(f"the server was not healthy within {timeout_name}:\n{tail(self.log_path)}")
            time.sleep(0.2)

    def stop(self, drain_timeout_s: float) -> Optional[str]:
        """SIGTERM (the server drains and exits 0); SIGKILL after the drain's bound. Returns a failure or None."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(drain_timeout_s + 30.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return f"the server did not stop within {drain_timeout_s + 30.0:.0f} s of SIGTERM; killed"
            if self.proc.returncode != 0:
                return f"the server exited with code {self.proc.returncode} on SIGTERM:\n{tail(self.log_path)}"
        return None
