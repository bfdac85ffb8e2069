"""Addresses of one llaunch instance, chosen so that several instances on one host never collide.

- Internal endpoints are `ipc://` sockets in a private directory (`tempfile.mkdtemp`), one per
  instance; with several nodes they are `tcp://` ports numbered from a base every node agrees on.
- TCP ports chosen here (torch.distributed rendezvous, KV transfer, server.port=0) are bind-probed and
  held twice: the probe socket stays bound until `handover()` (just before children bind them), and
  an flock'd lock file stays held until `close()`, so a concurrent llaunch skips them meanwhile
  (flock dies with its process, so a killed launcher leaves no stale reservation).
- The ipc directory holds an flock'd `owner.lock` for the launcher's life: a launcher killed with -9
  cannot remove its directory, but the next launch can prove it dead (the lock is free) and does
  (`remove_stale_ipc_dirs`).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Optional

LOCK_DIR = Path(tempfile.gettempdir()) / "llaunch-ports"
IPC_PREFIX = "llaunch-"
OWNER_LOCK = "owner.lock"
_ATTEMPTS = 200


def remove_stale_ipc_dirs(root: Optional[Path] = None) -> list[str]:
    """Remove the ipc directories whose launcher is gone (their owner lock is free); returns them."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(IPC_PREFIX + "*"):
        lock = d / OWNER_LOCK
        if not lock.is_file():
            continue  # not one of ours, or its launcher has not locked it yet
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its launcher is alive
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


class EndpointAllocator:
    def __init__(self, ipc_dir: Optional[str] = None, tcp_base_port: Optional[int] = None,
                 local_tcp: bool = False):
        """ipc mode (default): endpoints live in `ipc_dir` (None: a fresh private directory, made on
        first use). tcp mode (`tcp_base_port` set, for several nodes): `endpoint(name, host)` hands out
        tcp://host:port with ports counted up from the base in call order, identical on every node.
        local tcp mode (`local_tcp`, one node without a usable /tmp): every endpoint is a free port,
        reserved like `free_port`'s."""
        self._local_tcp = local_tcp
        self._ipc_dir = ipc_dir
        self._owns_ipc_dir = ipc_dir is None
        self._next_port = tcp_base_port
        self._probes: list[socket.socket] = []
        self._locks: list[tuple[int, int]] = []  # (port, lock file descriptor)
        self._owner_fd: Optional[int] = None

    @property
    def tcp(self) -> bool:
        return self._next_port is not None or self._local_tcp

    @property
    def ipc_dir(self) -> str:
        if self._ipc_dir is None:
            self._ipc_dir = tempfile.mkdtemp(prefix=IPC_PREFIX)  # short: ipc paths must fit 107 bytes
            self._owner_fd = os.open(os.path.join(self._ipc_dir, OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._owner_fd, fcntl.LOCK_EX)  # held until close() or this process dies
        return self._ipc_dir

    def endpoint(self, name: str, host: str = "127.0.0.1") -> str:
        """The address a process binds for `name` (e.g. "router.0.requests")."""
        if self._local_tcp:
            return f"tcp://{host}:{self.free_port(host)}"
        if self.tcp:
            port, self._next_port = self._next_port, self._next_port + 1
            return f"tcp://{host}:{port}"
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    def free_port(self, host: str = "127.0.0.1") -> int:
        """A TCP port free on `host` now and reserved for this instance (see the module docstring)."""
        for _ in range(_ATTEMPTS):
            probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            try:
                probe.bind((host, 0))
            except OSError:
                probe.close()
                raise
            port = probe.getsockname()[1]
            lock = _lock_port(port)
            if lock is not None:
                self._probes.append(probe)
                self._locks.append((port, lock))
                return port
            probe.close()  # another llaunch reserved it and has already handed it over
        raise RuntimeError(f"no free TCP port on {host} after {_ATTEMPTS} attempts")

    def handover(self) -> None:
        """Unbind the probe sockets so the children can bind their ports (the locks stay held)."""
        for probe in self._probes:
            probe.close()
        self._probes.clear()

    def close(self) -> None:
        """The instance is over: release every port and remove the private ipc directory."""
        self.handover()
        for port, fd in self._locks:
            _unlock_port(port, fd)
        self._locks.clear()
        if self._owns_ipc_dir and self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    def __enter__(self) -> "EndpointAllocator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lock_port(port: int) -> Optional[int]:
    """Hold <tmp>/llaunch-ports/<port>.lock; None when another process holds it."""
    LOCK_DIR.mkdir(mode=0o777, exist_ok=True)
    path = LOCK_DIR / f"{port}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path).st_ino:  # its holder unlinked it as we opened it
            raise OSError("stale lock file")
    except OSError:
        os.close(fd)
        return None
    return fd


def _unlock_port(port: int, fd: int) -> None:
    """Remove the lock file while still holding it (a racing locker sees the inode change), then drop it."""
    try:
        os.unlink(LOCK_DIR / f"{port}.lock")
    except OSError:
        pass
    os.close(fd)
