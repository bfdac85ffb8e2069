"""The worker's profiler on its own (runtime/worker/step_profiler.py): a profile of some ops is written as a trace
and a table; a start while one runs is ignored; a directory it cannot write loses the profile, not the worker."""
from __future__ import annotations

import gzip
import json

import torch

from llaunch.runtime.ipc.messages import Profile
from llaunch.runtime.worker.step_profiler import StepProfiler


def test_a_second_start_is_ignored_and_each_profile_gets_its_number(tmp_path):
    profiler = StepProfiler(str(tmp_path / "p"), "worker-0-1", cuda=False)
    for n in (1, 2):
        profiler.handle(Profile(start=True))
        profiler.handle(Profile(start=True, num_steps=1))  # ignored: the first runs on, until a stop
        torch.randn(64, 64) @ torch.randn(64, 64)
        profiler.stepped()
        assert profiler.running and not profiler.due
        profiler.stop()
        trace, table = profiler.written
        assert trace.name == f"worker-0-1-{n}.trace.json.gz"
        names = {e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]}
        assert "aten::mm" in names and "aten::mm" in table.read_text()
    profiler.stop()  # none running: nothing happens
    assert not profiler.running


def test_num_steps_makes_it_due_after_that_many_steps(tmp_path):
    profiler = StepProfiler(str(tmp_path), "w", cuda=False)
    profiler.handle(Profile(start=True, num_steps=2))
    profiler.stepped()
    assert not profiler.due
    profiler.stepped()
    assert profiler.due
    profiler.stop()
    assert not profiler.due and len(profiler.written) == 2


def test_a_directory_it_cannot_write_loses_the_profile_not_the_worker(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    profiler = StepProfiler(str(blocker / "profiles"), "w", cuda=False)
    profiler.handle(Profile(start=True))
    torch.ones(3).sum()
    profiler.stop()  # mkdir fails under a file: logged
    assert profiler.written == [] and not profiler.running
    assert "not written" in caplog.text
    profiler.handle(Profile(start=True))  # and it can start again
    assert profiler.running
    profiler.stop()
    assert not profiler.running
