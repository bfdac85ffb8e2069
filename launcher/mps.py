"""The CUDA MPS daemon for a graph's GPU processes (parallel.cuda_mps, LightLLM's enable_mps).

MPS lets the CUDA processes on a GPU share it through one server (kernels of different processes run
concurrently instead of time-slicing). The launcher starts a private control daemon whose pipe and log
directories live in a fresh directory under the temp dir (its pipe is a unix socket: the path must be
short), hands its children the environment that points them at it, and quits it when the graph is down,
so two instances on one host never share a daemon.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Optional

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """The daemon could not be started."""


def control_binary() -> Optional[str]:
    return shutil.which(CONTROL)


class MpsDaemon:
    def __init__(self):
        self.base: Optional[str] = None
        self.env: dict[str, str] = {}  # CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY once started

    def start(self) -> None:
        """`nvidia-cuda-mps-control -d`: forks the daemon and returns once it listens on its pipe."""
        binary = control_binary()
        if binary is None:
            raise MpsError(f"{CONTROL} is not on PATH")
        self.base = tempfile.mkdtemp(prefix="llaunch-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.base, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.base, "log")}
        for d in self.env.values():
            os.makedirs(d)
        try:
            subprocess.run([binary, "-d"], env=dict(os.environ, **self.env), check=True, timeout=30,
                           capture_output=True)
        except (OSError, subprocess.SubprocessError) as e:
            self._remove()
            raise MpsError(f"{CONTROL} -d failed: {e}") from e

    def stop(self) -> None:
        """Sends `quit` on the control pipe (the daemon exits once its clients are gone), then removes
        the directory."""
        if self.base is None:
            return
        binary = control_binary()
        if binary is not None:
            subprocess.run([binary], input=b"quit\n", env=dict(os.environ, **self.env), timeout=30, check=False)
        self._remove()

    def _remove(self) -> None:
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None
