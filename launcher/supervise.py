"""Start the planned process graph, wait for every process to report ready, then supervise it.

- Any process dying tears the whole graph down; llaunch exits 1 naming it, with its last log lines.
- SIGINT: stop at once. SIGTERM: drain (frontends refuse new requests and finish in-flight ones,
  bounded by server.drain_timeout_s), then stop everything and exit 0.
- No orphans: children run in their own sessions (so a terminal's Ctrl-C reaches only us), die with
  us (PR_SET_PDEATHSIG, see runtime/bootstrap.py), and are killed by process group at teardown.
- Several nodes (parallel.nnodes > 1): every node runs the same command; each launcher starts only
  its node's processes (launcher/plan.py processes_on). Node 0 runs the frontends, routers and
  detokenizer and binds the HTTP port; a node > 0 runs workers only and binds no HTTP port. When a
  node stops, the workers of the other nodes lose their tp peers or router and exit (runtime/worker/
  process.py PeerWatch, RouterWatch), so their launchers tear down and exit 1: no node waits forever.
"""
from __future__ import annotations

import contextlib
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

from llaunch.launcher.mps import MpsDaemon, MpsError
from llaunch.launcher.plan import processes_on
from llaunch.runtime.cache.host_pool import remove_pool
from llaunch.runtime.config import Mode, ProcessSpec, RunConfig
from llaunch.runtime.ipc.messages import LauncherInbound, ProcessReady, ProcessStage
from llaunch.runtime.ipc.sockets import Receiver

ROLE_MODULES = {
    "worker": "llaunch.runtime.worker.process",
    "router": "llaunch.runtime.router.process",
    "detokenizer": "llaunch.runtime.detokenizer.process",
    "frontend": "llaunch.runtime.http.process",
    "config_server": "llaunch.runtime.pd_master.config_server",
    "pd_master": "llaunch.runtime.pd_master.process",  # binds its own HTTP ports (no inherited fd)
    "kv_host": "llaunch.runtime.kv_host.process",  # owns the host KV tier's shared memory
    "visual": "llaunch.runtime.encoder.process",  # encodes images into the embed cache (multimodal models)
}
KEY_ROLES = ("frontend", "pd_master")  # the processes that check the API key
DRAINING_ROLES = ("frontend", "pd_master")  # the processes that answer HTTP and finish in-flight requests
# each depends on the ones before; config_server and pd_master run alone in their graphs
START_ORDER = ["kv_host", "visual", "worker", "router", "detokenizer", "frontend", "config_server", "pd_master"]
# A worker's exit status when a tp peer went away (runtime/worker/process.py EXIT_PEER_GONE): it
# died because another did, so it is not the one to blame.
PEER_GONE_EXIT = 3


def visible_devices(gpus: list[int]) -> str:
    """A worker's CUDA_VISIBLE_DEVICES: the plan's GPU indices count within the launcher's own
    CUDA_VISIBLE_DEVICES when it has one (`CUDA_VISIBLE_DEVICES=1 llaunch ...` runs on GPU 1)."""
    outer = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not outer:
        return ",".join(map(str, gpus))
    if max(gpus) >= len(outer):
        raise ValueError(f"the plan needs GPU {max(gpus)}, CUDA_VISIBLE_DEVICES={','.join(outer)} shows {len(outer)}")
    return ",".join(outer[g] for g in gpus)


console = Console(stderr=True, soft_wrap=True)  # piped into a log: whole lines, not 80 columns


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
        # this node's share of the graph (all of it on a single node)
        self.specs: dict[str, ProcessSpec] = {p.name: p for p in processes_on(cfg.graph, cfg.parallel.node_rank)}
        gpu_procs = any(spec.gpus for spec in self.specs.values())
        self.mps = MpsDaemon() if cfg.parallel.cuda_mps and gpu_procs else None

    @property
    def serves_http(self) -> bool:
        return any(spec.role == "frontend" for spec in self.specs.values())

    def start(self, http_fd: int | None, api_key: str | None = None) -> None:
        order = sorted(self.specs.values(), key=lambda p: START_ORDER.index(p.role))
        if self.mps is not None:
            self.mps.start()
        for spec in order:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if self.mps is not None and spec.gpus:
                env.update(self.mps.env)  # this process's CUDA context goes through the daemon
            pass_fds, argv = (), [sys.executable, "-m", ROLE_MODULES[spec.role], "--config", str(self.config_path),
                                  "--name", spec.name]
            if spec.gpus:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices(spec.gpus)
            if spec.role == "frontend":
                argv += ["--listen-fd", str(http_fd)]
                pass_fds = (http_fd,)
            log = open(self.log_dir / f"{spec.name}.log", "ab")
            gets_key = api_key is not None and spec.role in KEY_ROLES
            self.procs[spec.name] = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if gets_key else subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, pass_fds=pass_fds, start_new_session=True)
            log.close()
            if gets_key:  # the secret travels on stdin: not on a command line, not in the run dir
                self.procs[spec.name].stdin.write(f"{api_key}\n".encode())
                self.procs[spec.name].stdin.close()

    def check_alive(self, names=None) -> None:
        dead = [name for name, proc in self.procs.items()
                if (names is None or name in names) and proc.poll() is not None]
        if dead:  # name the cause, not a tp peer that followed it
            raise ProcessDied(min(dead, key=lambda n: self.procs[n].returncode == PEER_GONE_EXIT))

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
        # the HTTP processes stop at once (SIGINT) and end their open streams with an error event and
        # [DONE]; SIGTERM would make them drain, waiting for requests the graph can no longer finish
        front = [n for n in names if self.specs[n].role in DRAINING_ROLES]
        self.signal(front, signal.SIGINT)
        self.signal([n for n in names if n not in front], signal.SIGTERM)
        if not self.wait_exit(names, 3.0):
            self.signal(names, signal.SIGKILL)
            self.wait_exit(names, 10.0)
        for proc in self.procs.values():  # the group may outlive its leader: reap stragglers
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for spec in self.specs.values():  # a kv_host killed hard leaves its shared memory behind
            if spec.role == "kv_host":
                for path in spec.binds.values():
                    remove_pool(path)
            elif spec.role == "visual" and "embeds" in spec.binds:  # its embed cache's file (visual.tp's rank 0)
                remove_pool(spec.binds["embeds"])


class _Stop(Exception):
    def __init__(self, drain: bool):
        self.drain = drain


def _on_signal(signum, _frame):
    raise _Stop(drain=signum == signal.SIGTERM)


def wait_ready(graph: Graph, control: Receiver) -> None:
    """Until every process reported ready; meanwhile what the slow ones are doing (a spinner on a
    terminal, a line per stage in a log)."""
    pending = set(graph.procs)
    timeout_s = graph.cfg.server.ready_timeout_s
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    stages: dict[str, tuple[str, float]] = {}  # process → (stage, since)
    live = console.status("starting", spinner="dots") if console.is_terminal else contextlib.nullcontext()
    with live as status:
        while pending:
            graph.check_alive()
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"not ready after {timeout_s:.0f}s (server.ready_timeout_s): "
                                   f"{', '.join(sorted(pending))}")
            msg = control.recv(timeout_ms=100)
            if isinstance(msg, ProcessStage) and msg.name in pending:
                stages[msg.name] = (msg.stage, now)
                if status is None:
                    console.print(f"[dim]{msg.name}: {msg.stage} ({now - t0:.1f}s)[/]")
            elif isinstance(msg, ProcessReady) and msg.name in pending:
                pending.discard(msg.name)
                stages.pop(msg.name, None)
                extra = " ".join(f"{k}={v}" for k, v in msg.info.items())
                console.print(f"[green]ready[/] {msg.name} (pid {msg.pid}) {extra}")
            if status is not None:
                doing = "; ".join(f"{name}: {stage} {now - since:.0f}s"
                                  for name, (stage, since) in sorted(stages.items()))
                status.update(f"starting ({len(pending)} of {len(graph.procs)} to go, {now - t0:.0f}s) {doing}")


def drain(graph: Graph) -> None:
    frontends = [n for n, s in graph.specs.items() if s.role in DRAINING_ROLES]
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


def _serving_line(cfg: RunConfig, graph: Graph, ready_s: float) -> str:
    what = f"({len(graph.procs)} processes, ready in {ready_s:.1f}s; logs in {graph.log_dir})"
    p = cfg.parallel
    if cfg.mode.kind in (Mode.pd_master, Mode.config_server):  # one process that binds its own HTTP ports
        return f"[bold green]llaunch {cfg.mode.kind.value}[/] at {cfg.graph.http_url} {what}"
    if graph.serves_http:
        node = f" (node 0 of {p.nnodes})" if p.nnodes > 1 else ""
        metrics = "".join(f", metrics at {s.binds['metrics']}" for s in cfg.graph.processes if "metrics" in s.binds)
        return f"[bold green]llaunch serving[/] {cfg.model.name} at {cfg.graph.http_url}{node}{metrics} {what}"
    return (f"[bold green]llaunch node {p.node_rank} of {p.nnodes} joined[/]: workers of {cfg.model.name} "
            f"behind node 0's {cfg.graph.http_url} {what}")


def run_graph(cfg: RunConfig, api_key: str | None = None) -> int:
    config_path = Path(cfg.run_dir) / "config.yaml"
    graph = Graph(cfg, config_path)
    ctx = zmq.Context()
    control = Receiver(ctx, cfg.graph.control, LauncherInbound)
    # only the node that runs the frontends listens for HTTP
    http = bind_http_socket(cfg.server.host, cfg.server.port) if graph.serves_http else None
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        graph.start(http.fileno() if http is not None else None, api_key)
        if http is not None:
            # the frontends hold the listening socket now; once they exit, connections are refused at
            # once instead of queueing in a backlog nobody reads
            http.close()
        t0 = time.monotonic()
        wait_ready(graph, control)
        console.print(_serving_line(cfg, graph, time.monotonic() - t0))
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
    except (TimeoutError, MpsError) as e:
        console.print(f"[red]{e}[/]")
        code = 1
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_IGN)
        graph.kill_all()
        if graph.mps is not None:
            graph.mps.stop()
        if http is not None:
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
    if rc == PEER_GONE_EXIT and graph.cfg.parallel.nnodes > 1:
        console.print(f"[yellow]its router or tp peers on another node went away[/]: that node stopped or "
                      f"failed (node 0 serves at {graph.cfg.graph.http_url}); see its logs")
    return 1
