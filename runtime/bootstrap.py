"""What every child process does first: read the run config, find its own spec, tie its life to
the launcher's, and report ready on the control socket; and the SIGTERM flag its loop checks."""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from typing import Optional

import msgspec
import zmq

from llaunch.runtime.config import ProcessSpec, RunConfig
from llaunch.runtime.ipc.messages import ProcessReady, ProcessStage
from llaunch.runtime.ipc.sockets import Sender


def load_run_config(path: str) -> RunConfig:
    with open(path, "rb") as f:
        return msgspec.yaml.decode(f.read(), type=RunConfig)


def find_spec(cfg: RunConfig, name: str) -> ProcessSpec:
    for spec in cfg.graph.processes:
        if spec.name == name:
            return spec
    raise SystemExit(f"no process named {name!r} in the run config's graph")


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the launcher dies, so no process is ever orphaned."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before prctl took effect
            os._exit(1)


def start(argv: Optional[list[str]] = None) -> tuple[RunConfig, ProcessSpec]:
    """Parse `--config RUN_DIR/config.yaml --name NAME`, set up logging; returns (config, own spec)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--name", required=True)
    args = ap.parse_args(argv)
    die_with_parent()
    cfg = load_run_config(args.config)
    logging.basicConfig(level=cfg.log_level.value, format=f"%(asctime)s {args.name} %(levelname)s %(message)s",
                        stream=sys.stderr)
    return cfg, find_spec(cfg, args.name)


class StopFlag:
    """Set by SIGTERM once installed; the loop checks it between messages and exits cleanly."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> "StopFlag":
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "requested", True))
        return self


class StageReporter:
    """Tells the launcher each start-up stage of this process (shown while it waits for readiness)."""

    def __init__(self, ctx: zmq.Context, cfg: RunConfig, spec: ProcessSpec):
        self.name = spec.name
        self.sender = Sender(ctx, cfg.graph.control)

    def __call__(self, stage: str) -> None:
        self.sender.send(ProcessStage(name=self.name, stage=stage))

    def fraction(self, stage: str, step: float = 0.1):
        """A progress callback for `stage`: reports each further `step` of the work done (10%, 20%, ...)."""
        reported = [0.0]

        def progress(done: float) -> None:
            if done - reported[0] >= step and done < 1.0:
                reported[0] = done
                self(f"{stage} {done:.0%}")

        return progress

    def close(self) -> None:
        self.sender.close()


def report_ready(ctx: zmq.Context, cfg: RunConfig, spec: ProcessSpec, **info: str) -> None:
    sender = Sender(ctx, cfg.graph.control)
    sender.send(ProcessReady(name=spec.name, pid=os.getpid(), info={k: str(v) for k, v in info.items()}))
    sender.close()
