"""The CUDA MPS daemon for a graph's GPU processes (parallel.cuda_mps, LightLLM's enable_mps).

MPS lets the CUDA processes on a GPU share it through one server (kernels of different processes run
concurrently instead of time-slicing). The launcher starts a private control daemon whose pipe and log
directories live in the run directory, hands its children the environment that points them at it,
and quits it when the graph is down, so two instances on one host never share a daemon.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

CONTROL = "nvidia-cuda-mps-control"


def control_binary() -> Optional[str]:
    return shutil.which(CONTROL)


class MpsDaemon:
    def __init__(self, run_dir: str):
        base = Path(run_dir) / "mps"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log")}
        self.started = False

    def start(self) -> None:
        """`nvidia-cuda-mps-control -d`: forks the daemon and returns once it listens on its pipe."""
        for d in self.env.values():
            os.makedirs(d, exist_ok=True)
        binary = control_binary()
        if binary is None:
            raise RuntimeError(f"{CONTROL} is not on PATH")
        subprocess.run([binary, "-d"], env=dict(os.environ, **self.env), check=True, timeout=30)
        self.started = True

    def stop(self) -> None:
        """Sends `quit` on the control pipe: the daemon exits once its clients are gone."""
        if not self.started:
            return
        self.started = False
        binary = control_binary()
        if binary is not None:
            subprocess.run([binary], input=b"quit\n", env=dict(os.environ, **self.env), timeout=30, check=False)
