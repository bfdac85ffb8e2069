"""Start the planned process graph, wait for every process to report ready, then supervise it.

- Any process dying tears the whole graph down; llaunch exits 1 naming it, with its last log lines.
- SIGINT: stop at once. SIGTERM: drain (frontends refuse new requests and finish in-flight ones,
  bounded by server.drain_timeout_s), then stop everything and exit 0.
- No orphans: children run in their own sessions (so a terminal's Ctrl-C reaches only us), die with
  us (PR_SET_PDEATHSIG, see runtime/bootstrap.py), and are killed by process group at teardown.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import zmq
from rich.console import Console

from llaunch.launcher.schema import ProcessSpec, RunConfig
from llaunch.runtime.ipc.messages import LauncherInbound, ProcessReady
from llaunch.runtime.ipc.sockets import Receiver

ROLE_MODULES = {
    "worker": "llaunch.runtime.worker.process",
    "router": "llaunch.runtime.router.process",
    "detokenizer": "llaunch.runtime.detokenizer.process",
    "frontend": "llaunch.runtime.http.process",
}
START_ORDER = ["worker", "router", "detokenizer", "frontend"]  # each depends on the ones before
READY_TIMEOUT_S = float(os.environ.get("LLAUNCH_READY_TIMEOUT_S", "900"))
console = Console(stderr=True)


class ProcessDied(Exception):
    pass


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The launcher owns the listening socket and hands it to every frontend worker as an fd."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


class Graph:
    def __init__(self, cfg: RunConfig, config_path: Path):
        self.cfg = cfg
        self.config_path = config_path
        self.log_dir = Path(cfg.run_dir) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, ProcessSpec] = {p.name: p for p in cfg.graph.processes}

    def start(self, http_fd: int) -> None:
        order = sorted(self.cfg.graph.processes, key=lambda p: START_ORDER.index(p.role))
        for spec in order:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            pass_fds = ()
            if spec.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpus))
            if spec.role == "frontend":
                env["LLAUNCH_HTTP_FD"] = str(http_fd)
                pass_fds = (http_fd,)
            log = open(self.log_dir / f"{spec.name}.log", "ab")
            self.procs[spec.name] = subprocess.Popen(
                [sys.executable, "-m", ROLE_MODULES[spec.role], "--config", str(self.config_path), "--name", spec.name],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=pass_fds,
                start_new_session=True)
            log.close()

    def check_alive(self, names=None) -> None:
        for name, proc in self.procs.items():
            if (names is None or name in names) and proc.poll() is not None:
                raise ProcessDied(name)

    def last_lines(self, name: str, n: int = 25) -> str:
        try:
            lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def signal(self, names, sig) -> None:
        for name in names:
            proc = self.procs[name]
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def wait_exit(self, names, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                self.procs[name].wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill_all(self) -> None:
        names = list(self.procs)
        self.signal(names, signal.SIGTERM)
        if not self.wait_exit(names, 3.0):
            self.signal(names, signal.SIGKILL)
            self.wait_exit(names, 10.0)
        for proc in self.procs.values():  # the group may outlive its leader: reap stragglers
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class _Stop(Exception):
    def __init__(self, drain: bool):
        self.drain = drain


def _on_signal(signum, _frame):
    raise _Stop(drain=signum == signal.SIGTERM)


def wait_ready(graph: Graph, control: Receiver) -> None:
    pending = set(graph.procs)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while pending:
        graph.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {READY_TIMEOUT_S:.0f}s: {', '.join(sorted(pending))}")
        msg = control.recv(timeout_ms=100)
        if isinstance(msg, ProcessReady) and msg.name in pending:
            pending.discard(msg.name)
            extra = " ".join(f"{k}={v}" for k, v in msg.info.items())
            console.print(f"[green]ready[/] {msg.name} (pid {msg.pid}) {extra}")


def drain(graph: Graph) -> None:
    frontends = [n for n, s in graph.specs.items() if s.role == "frontend"]
    console.print("[yellow]SIGTERM: draining[/] (new requests get 503, in-flight ones finish)")
    graph.signal(frontends, signal.SIGTERM)
    deadline = time.monotonic() + graph.cfg.server.drain_timeout_s + 5.0
    others = [n for n in graph.procs if n not in frontends]
    while time.monotonic() < deadline:
        graph.check_alive(others)  # a crash during the drain still fails the run
        if all(graph.procs[n].poll() is not None for n in frontends):
            return
        time.sleep(0.1)
    console.print("[red]drain timed out[/]; stopping anyway")


def run_graph(cfg: RunConfig) -> int:
    config_path = Path(cfg.run_dir) / "config.yaml"
    host, port = cfg.server.host, cfg.server.port
    graph = Graph(cfg, config_path)
    ctx = zmq.Context()
    control = Receiver(ctx, cfg.graph.control, LauncherInbound)
    http = bind_http_socket(host, port)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        graph.start(http.fileno())
        # the frontends hold the listening socket now; once they exit, connections are refused at
        # once instead of queueing in a backlog nobody reads
        http.close()
        t0 = time.monotonic()
        wait_ready(graph, control)
        console.print(f"[bold green]llaunch serving[/] {cfg.model.name} at {cfg.graph.http_url} "
                      f"({len(graph.procs)} processes, ready in {time.monotonic() - t0:.1f}s; "
                      f"logs in {graph.log_dir})")
        while True:
            graph.check_alive()
            time.sleep(0.1)
    except _Stop as stop:
        if stop.drain:
            try:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                drain(graph)
            except ProcessDied as died:
                code = _report_death(graph, died)
            except _Stop:
                pass
        else:
            console.print("[yellow]SIGINT: stopping[/]")
            code = 130
    except ProcessDied as died:
        code = _report_death(graph, died)
    except TimeoutError as e:
        console.print(f"[red]{e}[/]")
        code = 1
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_IGN)
        graph.kill_all()
        http.close()
        control.close()
        ctx.term()
        shutil.rmtree(cfg.graph.ipc_dir, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)
    return code


def _report_death(graph: Graph, died: ProcessDied) -> int:
    name = died.args[0]
    rc = graph.procs[name].returncode
    console.print(f"[bold red]process {name} exited with code {rc}[/]; stopping the graph. Last log lines "
                  f"({graph.log_dir / (name + '.log')}):")
    console.print(graph.last_lines(name), markup=False, highlight=False)
    return 1
