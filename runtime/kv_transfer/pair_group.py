"""Pairing two independently started instances for KV transfer, with no process group in common.

The decode rank hosts a TCPStore at the nccl://host:port it advertises, and a control listener whose
port it puts in that store. A prefill rank that joins takes a pair number n from a counter in the
store, connects to the control listener and says hello with n, and the decode rank welcomes it (or
says why not); then both sides build a 2-rank data group directly on PrefixStore(f"pair/{n}", store)
(NCCL on CUDA, gloo on CPU), which torch.distributed never registers: a default group the instance
has (its tensor-parallel one) is never touched.

Headers and aborts travel on the control socket, page bytes on the data group, posted only once a
header announced them. So an idle link waits in a Python socket read: it costs the GPU nothing, holds
no NCCL operation open for hours, sees a dead peer at once (EOF/reset), can be ended by closing the
socket, and no thread sits in a torch call when the process exits (a daemon thread that returns from
one during interpreter shutdown aborts the process).

NCCL creates its communicator lazily and collectively at the first operation, so both sides exchange a
handshake tensor right after building the group. A NCCL group is never freed while the process runs
(see _retire), and a GPU where a NCCL operation got stuck takes no new pairs (see stuck_devices).
Every step is named: a join that fails or blocks says which step, of which pair, for how long.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Iterator, Optional
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from llaunch.runtime.kv_transfer.pair_control import ControlFrame, ControlSocket, LinkBroken, PairHello, PairWelcome

log = logging.getLogger(__name__)

JOINED_KEY = "pair/joined"  # counter: the n-th prefill rank to join gets pair n
BACKEND_KEY = "pair/backend"  # the decode rank's data backend: a mismatched joiner fails at once
CONTROL_PORT_KEY = "pair/control_port"
_env_lock = threading.Lock()


class JoinError(RuntimeError):
    pass


def parse_address(address: str) -> tuple[str, int]:
    parts = urlsplit(address)
    if parts.scheme != "nccl" or not parts.hostname or parts.port is None:
        raise ValueError(f"a KV pairing address is nccl://host:port, got {address!r}")
    return parts.hostname, parts.port


def data_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def whoami(device: torch.device) -> str:
    return f"pid {os.getpid()} on {socket.gethostname()} ({device})"


# A NCCL operation whose peer died stays a running kernel: it cannot be aborted (see _retire), and
# creating a communicator on that GPU then hangs the process's CUDA calls (seen on 2 H200s). So once
# one missed its deadline, the device takes no new pairs; the instance should report itself unhealthy.
stuck_devices: dict[str, str] = {}  # str(device) -> what is stuck there


def stuck_reason(device: torch.device) -> Optional[str]:
    return stuck_devices.get(str(device))


def join_overdue(steps: "JoinSteps", device: torch.device, timeout_s: float) -> None:
    """A join past its deadline: when it has been inside NCCL communicator creation (which has no
    deadline of its own and cannot be aborted) for `timeout_s`, the GPU is recorded as stuck like a
    stuck operation is, so the worker exits instead of pairing next to a communicator that never
    finishes. A join that only just reached that step is left alone."""
    in_nccl = steps.step.startswith(("data group construction", "data handshake"))
    if device.type == "cuda" and in_nccl and time.monotonic() - steps.since >= timeout_s:
        stuck_devices.setdefault(str(device), f"{steps.describe()}: NCCL communicator creation never finished")


# ---- both groups of one pair --------------------------------------------------------------------


class PairLink:
    """One pair seen from one side (rank 0: the prefill rank, rank 1: the decode rank)."""

    def __init__(self, n: int, rank: int, control: ControlSocket, data, device: torch.device, timeout_s: float,
                 store: dist.TCPStore, peer: str):
        self.n, self.rank, self.control, self.data, self.device = n, rank, control, data, device
        self.timeout_s, self.peer = timeout_s, peer
        self.nccl = device.type == "cuda"
        # NCCL orders its work after the caller's current stream: ours, not the model's default stream
        self.stream = torch.cuda.Stream(device) if self.nccl else None
        self.broken: Optional[str] = None
        self._store = store  # the PrefixStore the data group was built on refers to this connection

    @property
    def other(self) -> int:
        return 1 - self.rank

    def send_control(self, frame: ControlFrame, what: str) -> None:
        self._guard(lambda: self.control.send(frame), what)

    def recv_control(self, what: str) -> ControlFrame:
        return self._guard(self.control.recv, what)

    def send_data(self, data: torch.Tensor, what: str) -> None:
        flat = data.reshape(-1).view(torch.uint8)
        with self._on_stream():
            self._guard(lambda: self._wait(self.data.send([flat], self.other, 0), what), what)

    def recv_data(self, nbytes: int, what: str) -> torch.Tensor:
        with self._on_stream():
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._guard(lambda: self._wait(self.data.recv([buf], self.other, 0), what), what)
        return buf

    def handshake(self) -> None:
        """The data group's first operation: creates the NCCL communicator on both sides now."""
        with self._on_stream():  # the token's fill and read are ordered on our stream, as NCCL's op is
            if self.rank == 0:
                self.send_data(torch.full((1,), self.n, dtype=torch.int64, device=self.device), "data handshake")
                return
            got = int(self.recv_data(8, "data handshake").view(torch.int64).item())
        if got != self.n:
            raise LinkBroken(f"data handshake carried pair number {got}, expected {self.n}")

    def close(self) -> None:
        """Ends the control connection. A NCCL group is never freed (see _retire)."""
        self.control.close()
        if self.nccl and self.data is not None:
            _retire(self.data)
        self.data = None

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def _wait(self, work, what: str) -> None:
        if self.nccl:  # poll, so the wait never depends on TORCH_NCCL_BLOCKING_WAIT or the torch version
            deadline, spins = time.monotonic() + self.timeout_s, 0
            while not work.is_completed():
                if time.monotonic() > deadline:
                    why = (f"not complete after {self.timeout_s}s: its NCCL kernel stays stuck on "
                           f"{self.device} (this process should be restarted)")
                    stuck_devices.setdefault(str(self.device), f"pair {self.n} with {self.peer}: {what}: {why}")
                    raise TimeoutError(why)
                spins += 1
                time.sleep(0 if spins < 2000 else 0.0005)
            work.wait()  # raises what NCCL reported; orders our stream after the operation
        else:  # gloo: is_completed() never turns true for p2p
            work.wait(timedelta(seconds=self.timeout_s))

    def _guard(self, op, what: str):
        """Any failure breaks the link: a half-done exchange cannot be resynchronised. The caller
        fails its transfers first, then closes the link."""
        if self.broken is not None:
            raise LinkBroken(self.broken)
        try:
            return op()
        except Exception as e:
            self.broken = f"pair {self.n} with {self.peer}: {what} failed: {e}"
            raise LinkBroken(self.broken) from e


# ---- joining ------------------------------------------------------------------------------------


class JoinSteps:
    """The step a join is in and since when, for messages about one that failed or blocks."""

    def __init__(self, who: str):
        self.who, self.step, self.since = who, "starting", time.monotonic()

    @contextlib.contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        self.step, self.since = step, time.monotonic()
        log.info("%s: %s", self.who, step)
        try:
            yield
        except Exception as e:
            raise JoinError(f"{self.who}: {step} failed after {time.monotonic() - self.since:.1f}s: {e}") from e

    def describe(self) -> str:
        return f"{self.who}: blocked at step '{self.step}' for {time.monotonic() - self.since:.1f}s"


def host_pairing(host: str, port: int, device: torch.device, timeout_s: float) -> tuple[dist.TCPStore, socket.socket]:
    """The decode rank's store (port 0: any free port, see `.port`) and control listener."""
    store = dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    listener = socket.create_server((host, 0), backlog=64)
    store.set(BACKEND_KEY, data_backend(device))
    store.set(CONTROL_PORT_KEY, str(listener.getsockname()[1]))
    return store, listener


def _client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A connection of its own per link: a TCPStore client serialises its calls, so one link's blocking
    get must not stall another's."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


_retired: list = []


def _retire(group) -> None:
    """Keeps a NCCL group alive until the process exits, destructor included. Freeing one (abort,
    shutdown, the destructor) waits for its intra-node peer and may synchronize the device: with the
    peer gone, or a NCCL kernel stuck on the GPU, abort() hung for the group's timeout and stalled
    every other pair's transfers (seen on 2 H200s, torch 2.11, NCCL 2.28). The cost: the group's GPU
    memory (0.75-0.9 GiB per side there) until exit."""
    _retired.append(group)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never destroyed, not even at interpreter exit


def _data_group(store, rank: int, device: torch.device, n: int, timeout_s: float):
    if device.type != "cuda":
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    # The watchdog's timeout must never fire: we keep our own deadline per operation and cannot abort
    # (see _retire), so a stuck operation would only make it dump and log.
    opts._timeout = timedelta(days=7)
    if hasattr(opts, "group_name"):
        opts.group_name = f"llaunch-kv-pair-{n}"
    with _env_lock, _environment(_NCCL_GROUP_ENV):
        return dist.ProcessGroupNCCL(store, rank, 2, opts)


# Read by ProcessGroupNCCL's constructor, so they apply to the pair groups alone: by default a dead
# peer tears the whole process down (here it must fail only its link), and the watchdog polls the
# group's store for a dump signal (here that store is the decode rank's, which may be gone).
_NCCL_GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _finish(store, n: int, rank: int, control: ControlSocket, device: torch.device, timeout_s: float,
            steps: JoinSteps, peer: str) -> PairLink:
    backend = data_backend(device)
    try:
        with steps(f"data group construction ({backend} on {device})"):
            data = _data_group(dist.PrefixStore(f"pair/{n}", store), rank, device, n, timeout_s)
    except JoinError:
        control.close()
        raise
    link = PairLink(n, rank, control, data, device, timeout_s, store, peer)
    what = "data handshake" + (" (NCCL communicator creation; the two sides must be on different GPUs)"
                               if backend == "nccl" else "")
    try:
        with steps(what):
            link.handshake()
    except JoinError:
        link.close()
        raise
    log.info("%s: ready", steps.who)
    return link


def join_as_sender(address: str, device: torch.device, timeout_s: float, steps: JoinSteps) -> PairLink:
    """The prefill side (rank 0). Blocks until the link works, or raises JoinError naming the step."""
    host, port = parse_address(address)
    if stuck_reason(device) is not None:
        raise JoinError(f"{steps.who}: this process takes no new pairs on {device}: {stuck_reason(device)}")
    with steps(f"connecting to the decode rank's store at {host}:{port}"):
        store = _client_store(host, port, timeout_s)
    with steps("reading the decode rank's data backend and control port"):
        theirs, control_port = store.get(BACKEND_KEY).decode(), int(store.get(CONTROL_PORT_KEY))
    if theirs != data_backend(device):
        raise JoinError(f"{steps.who}: the decode rank at {address} moves KV with {theirs}, this prefill rank "
                        f"({device}) with {data_backend(device)}: put both on GPUs or both on CPU")
    with steps("taking a pair number"):
        n = store.add(JOINED_KEY, 1)
    steps.who = f"{steps.who} (pair {n})"
    with steps(f"connecting to the control listener at {host}:{control_port}"):
        control = ControlSocket(socket.create_connection((host, control_port), timeout=timeout_s))
        control.send(PairHello(n, whoami(device)))  # the socket keeps its timeout: sends never hang
    try:
        with steps("waiting for the decode rank's welcome"):
            welcome = control.recv()
            if not isinstance(welcome, PairWelcome):
                raise LinkBroken(f"expected a welcome, got {type(welcome).__name__}")
        if welcome.refused:
            raise JoinError(f"{steps.who}: the decode rank refused the pair: {welcome.refused}")
    except JoinError:
        control.close()
        raise
    return _finish(store, n, 0, control, device, timeout_s, steps, peer=f"decode rank {address}")


def join_as_receiver(host: str, port: int, conn: socket.socket, device: torch.device, timeout_s: float,
                     steps: JoinSteps) -> PairLink:
    """The decode side (rank 1) of the pair that just connected to the control listener."""
    control = ControlSocket(conn)
    try:
        with steps("reading the hello"):
            conn.settimeout(timeout_s)
            hello = control.recv()
            if not isinstance(hello, PairHello):
                raise LinkBroken(f"expected a hello, got {type(hello).__name__}")
            refused = stuck_reason(device) or ""
            control.send(PairWelcome(refused))
            conn.settimeout(None)  # from now on it waits for headers, however long the link idles
        steps.who = f"{steps.who} pair {hello.n} ({hello.who})"
        if refused:
            raise JoinError(f"{steps.who}: refused: this process takes no new pairs on {device}: {refused}")
        with steps("connecting a store client for this pair"):
            store = _client_store(host, port, timeout_s)
    except JoinError:
        control.close()
        raise
    return _finish(store, hello.n, 1, control, device, timeout_s, steps, peer=hello.who)
