"""How many CPUs this process may really use: its CPU affinity (taskset, a container's cpuset) and its
cgroup's CPU quota (docker --cpus, a Kubernetes CPU limit), not os.cpu_count(), which counts the
host's cores. A CPU worker that ran os.cpu_count() torch threads on a shared 2-core host took 1.9 s a
token against 245 ms with one. Files are read under `root`, so tests give a fake /proc and /sys."""
from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath
from typing import Optional


def usable_cpus(root: Path = Path("/")) -> int:
    """The CPUs this process may run on at once: its affinity, capped by its cgroup's quota (at least 1)."""
    cpus = _affinity(root)
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))  # 1.5 CPUs: one thread, not two that get throttled
    return max(1, cpus)


def _affinity(root: Path) -> int:
    """CPUs in this process's affinity mask (/proc/self/status Cpus_allowed_list: "0-3,8")."""
    try:
        for line in (root / "proc/self/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return sum(_range_size(part) for part in line.split(":", 1)[1].strip().split(",") if part)
    except OSError:
        pass
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _range_size(part: str) -> int:
    low, _, high = part.partition("-")
    return int(high or low) - int(low) + 1


def cgroup_cpu_quota(root: Path = Path("/")) -> Optional[float]:
    """The CPU quota of this process's cgroup and its ancestors (the smallest), in CPUs; None when
    unlimited. cgroup v2 (cpu.max "200000 100000"), or v1 (cpu.cfs_quota_us / cpu.cfs_period_us)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy, mounted alone or beside v1 ones
            for mount in ("sys/fs/cgroup", "sys/fs/cgroup/unified"):
                quotas += _walk(root / mount, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in dict.fromkeys((controllers, "cpu", "cpu,cpuacct")):
                quotas += _walk(root / "sys/fs/cgroup" / mount, path, _v1_quota)
    return min(quotas) if quotas else None


def _walk(mount: Path, path: str, read) -> list[float]:
    """The quotas set on `path`'s cgroup and every ancestor up to the mount (a container sees its own
    cgroup as the mount's root, so the mount itself is read too)."""
    found = []
    node = PurePosixPath(path)
    while True:
        quota = read(mount / str(node).lstrip("/"))
        if quota is not None:
            found.append(quota)
        if node == node.parent:
            return found
        node = node.parent


def _v2_quota(folder: Path) -> Optional[float]:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> Optional[float]:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
