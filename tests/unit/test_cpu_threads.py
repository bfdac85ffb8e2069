"""The CPU worker's torch threads: the CPUs the process may use (its affinity, its cgroup's quota),
not the host's core count; device_threads overrides. Each case writes the /proc and /sys files a
host or container would show under a temporary root."""
from __future__ import annotations

from pathlib import Path

import pytest

from llaunch.runtime.config import ParallelConfig, RunConfig
from llaunch.runtime.cpu_quota import cgroup_cpu_quota, usable_cpus
from llaunch.runtime.worker.process import cpu_threads


def fake_root(tmp_path: Path, cpus: str, cgroup: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/status").write_text(f"Name:\tpython\nCpus_allowed:\tff\nCpus_allowed_list:\t{cpus}\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


V1 = "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n"

CASES = {
    # (affinity, /proc/self/cgroup, files) → usable CPUs
    "a 64-core host, no limit": ("0-63", "0::/user.slice\n", {"sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"}, 64),
    "taskset -c 0,4-5": ("0,4-5", "0::/\n", {}, 3),
    "docker --cpus=2 (v2, namespaced)": ("0-63", "0::/\n", {"sys/fs/cgroup/cpu.max": "200000 100000\n"}, 2),
    "a Kubernetes limit of 1500m: one thread": ("0-63", "0::/\n", {"sys/fs/cgroup/cpu.max": "150000 100000\n"}, 1),
    "a limit on a parent cgroup (v2)": ("0-31", "0::/kubepods/pod1/ctr\n", {
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "400000 100000\n"}, 4),
    "v1 cfs quota": ("0-15", V1, {"sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
                                  "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}, 3),
    "v1 unlimited (-1), hybrid layout": ("0-1", "1:cpu:/\n0::/\n", {
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/unified/cgroup.procs": ""}, 2),
    "a quota above the affinity": ("0-1", "0::/\n", {"sys/fs/cgroup/cpu.max": "800000 100000\n"}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_usable_cpus_from_affinity_and_cgroup_quota(tmp_path, case):
    cpus, cgroup, files, want = CASES[case]
    assert usable_cpus(fake_root(tmp_path, cpus, cgroup, files)) == want


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None
    assert usable_cpus(fake_root(tmp_path, "0-5", "", {})) == 6


def test_worker_threads_share_the_usable_cpus_and_device_threads_overrides(tmp_path):
    root = fake_root(tmp_path, "0-63", "0::/\n", {"sys/fs/cgroup/cpu.max": "400000 100000\n"})  # 64 cores, 4 CPUs
    assert cpu_threads(RunConfig(), root) == 4  # not 64: the threads fought over 4 CPUs
    assert cpu_threads(RunConfig(parallel=ParallelConfig(tp=2)), root) == 2  # two ranks on this node
    assert cpu_threads(RunConfig(parallel=ParallelConfig(tp=8)), root) == 1
    assert cpu_threads(RunConfig(parallel=ParallelConfig(tp=2, nnodes=2)), root) == 4  # one rank per node
    assert cpu_threads(RunConfig(device_threads=3), root) == 3
