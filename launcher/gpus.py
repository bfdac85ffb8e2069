"""How many GPUs this process may use, without importing torch (planning and dry runs stay fast).

NVIDIA GPUs are counted through NVML (the driver's own library) and then narrowed by
CUDA_VISIBLE_DEVICES as CUDA does; where NVML is missing (other vendors' drivers), a child process
asks torch, so the launcher itself never imports it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys

_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _nvml_count() -> int | None:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
    finally:
        nvml.nvmlShutdown()


class _MemoryInfo(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


@functools.cache
def memory_bytes() -> int | None:
    """The smallest total memory of this machine's NVIDIA GPUs (NVML), or None where NVML cannot tell."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count, sizes = ctypes.c_uint(0), []
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        for i in range(count.value):
            handle, info = ctypes.c_void_p(), _MemoryInfo()
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) == 0 \
                    and nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)) == 0:
                sizes.append(info.total)
        return min(sizes) if sizes else None
    finally:
        nvml.nvmlShutdown()


def _torch_count() -> int:
    """torch's count, in a child process (it honours CUDA_VISIBLE_DEVICES itself)."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return int(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def narrow(physical: int, visible: str | None) -> int:
    """The devices CUDA shows under CUDA_VISIBLE_DEVICES=`visible` out of `physical`: entries up to the
    first invalid one (CUDA stops there), indices below `physical`, UUIDs taken as valid."""
    if visible is None:
        return physical
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < physical or entry.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break
    return min(count, physical)


@functools.cache
def visible_count() -> int:
    """GPUs this process (and the children it starts) can use."""
    if not any(os.path.exists(p) for p in _DEVICE_NODES):
        return 0
    physical = _nvml_count()
    if physical is None:
        return _torch_count()
    return narrow(physical, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_ids() -> list[str]:
    """The launcher's GPUs as CUDA_VISIBLE_DEVICES entries for its children."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()][:visible_count()]
    return [str(i) for i in range(visible_count())]
