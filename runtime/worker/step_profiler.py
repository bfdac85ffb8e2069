"""torch.profiler over a served worker's steps (POST /start_profile, /stop_profile; server.profile_dir).

Between two steps the worker starts the profiler; at a stop (or after `num_steps` launched steps) it finishes
the steps in flight, stops it and writes two files per rank under the directory: a Chrome / Perfetto trace
(`<name>.trace.json.gz`) and the ops and kernels by time (`<name>.kernels.txt`: device time first where there
is a GPU). <name> is worker-<dp>-<tp rank>-<profile number>, so the ranks and successive profiles of one server
never overwrite each other. A start while one runs and a stop while none runs change nothing (logged)."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from llaunch.runtime.ipc.messages import Profile

log = logging.getLogger("llaunch.worker")

ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}
TABLE_ROWS = 60


class StepProfiler:
    def __init__(self, directory: Optional[str], label: str, cuda: bool):
        self.directory = Path(directory) if directory else None
        self.label, self.cuda = label, cuda
        self._prof: Optional[profile] = None
        self._left, self._limited = 0, False  # steps still to profile, when a start gave num_steps
        self._count = 0
        self.written: list[Path] = []  # the last profile's files (tests read them)

    @property
    def running(self) -> bool:
        return self._prof is not None

    @property
    def due(self) -> bool:
        """A num_steps profile has seen its last step launched: finish the steps in flight, then stop()."""
        return self._prof is not None and self._left == 0 and self._limited

    def handle(self, msg: Profile) -> None:
        """A start (a stop goes through stop(), after the steps in flight are finished)."""
        if self.directory is None:  # the frontend refuses the routes then; a message is a bug upstream
            log.warning("profile message without server.profile_dir: ignored")
            return
        if self._prof is not None:
            log.warning("a profile is already running: the start is ignored")
            return
        names = msg.activities or list(ACTIVITIES)
        activities = [ACTIVITIES[a] for a in names if a != "GPU" or self.cuda]
        prof = profile(activities=activities, record_shapes=msg.record_shapes, with_stack=msg.with_stack)
        try:
            prof.start()
        except RuntimeError as e:  # another profiler holds CUPTI, say: the worker serves on without one
            log.error("the profiler did not start: %s", e)
            return
        self._prof = prof
        self._left, self._limited = msg.num_steps, msg.num_steps > 0
        log.info("profiling %s (%s)", f"{msg.num_steps} steps" if msg.num_steps else "until /stop_profile",
                 ", ".join(names))

    def stepped(self) -> None:
        if self._prof is not None and self._limited and self._left > 0:
            self._left -= 1

    def stop(self) -> None:
        if self._prof is None:
            log.warning("no profile is running: the stop is ignored")
            return
        if self.cuda:
            torch.cuda.synchronize()  # every kernel launched so far ends inside the trace
        prof, self._prof = self._prof, None
        prof.stop()
        self._count += 1
        base = self.directory / f"{self.label}-{self._count}"
        trace, table = (base.with_name(base.name + suffix) for suffix in (".trace.json.gz", ".kernels.txt"))
        t0 = time.monotonic()  # the worker takes no step while it writes (seconds for a long profile)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace))
            sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            table.write_text(prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS) + "\n")
        except OSError as e:  # a full or read-only disk loses the profile, not the worker
            log.error("profile %d not written to %s: %s", self._count, self.directory, e)
            return
        self.written = [trace, table]
        log.info("profile written to %s and %s (%.1f s)", trace, table.name, time.monotonic() - t0)
