"""Rich progress for a sweep of benchmark jobs: a bar for the sweep (jobs done of all), one per running
job (its stages), and one line per finished job with its headline figures or why it failed."""
from __future__ import annotations

import atexit
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn


@dataclass(frozen=True)
class SweepShape:
    size: Optional[int]  # jobs in the sweep; None: unknown
    keys: tuple[str, ...] = ()  # the swept override keys
    tuning: bool = False  # a tuning sweep: each job's line shows its score and the best so far


def sweep_shape(sweep_overrides: list[str]) -> SweepShape:
    """What Hydra's basic sweeper makes of these overrides: the product of the sweep lists."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    size, keys = 1, []
    for override in OverridesParser.create().parse_overrides(sweep_overrides):
        if override.is_sweep_override() and not override.is_hydra_override():
            size *= len(list(override.sweep_string_iterator()))
            keys.append(override.key_or_group)
    return SweepShape(size, tuple(keys))


def output_root(hydra_cfg) -> Path:
    """The sweep's directory (a multirun) or the job's own (a single run)."""
    from hydra.types import RunMode

    root = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:  # strip the job's subdir: re-reading sweep.dir re-runs ${now:}
        for _ in Path(str(hydra_cfg.sweep.subdir)).parts:
            root = root.parent
    return root


def sweep_shape_of(hydra_cfg) -> SweepShape:
    """The running sweep's shape, from the multirun.yaml Hydra writes before the first job."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return SweepShape(1)
    try:
        multirun = OmegaConf.load(output_root(hydra_cfg) / "multirun.yaml")
        return sweep_shape(list(multirun.hydra.overrides.task))
    except Exception:  # another sweeper or launcher layout: the bar just has no total
        return SweepShape(None)


@dataclass
class _Job:
    label: str
    stages: tuple[str, ...]
    done: int = 0


class SweepProgress:
    _shared: Optional["SweepProgress"] = None

    def __init__(self, shape: SweepShape, console: Optional[Console] = None, done: int = 0):
        self.console = console or Console(stderr=True)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=self.console)
        self.sweep = self.progress.add_task("[bold]sweep[/]", total=shape.size, completed=done)
        self.shape, self.done, self.failed = shape, done, 0  # done: a resumed study's earlier trials
        self.best: Optional[tuple[float, str]] = None  # a tuning sweep's best score and its job
        self._jobs: dict[TaskID, _Job] = {}
        atexit.register(self.progress.stop)

    @classmethod
    def shared(cls, hydra_cfg) -> "SweepProgress":
        """One display for every job the default launcher runs in this process."""
        if cls._shared is None:
            cls._shared = cls(sweep_shape_of(hydra_cfg))
        return cls._shared

    def _describe(self, task: TaskID) -> None:
        job = self._jobs[task]
        stage = job.stages[min(job.done, len(job.stages) - 1)]
        self.progress.update(task, completed=job.done, description=f"{job.label} [dim]· {escape(stage)}[/]")

    def start_job(self, num: int, overrides: list[str], stages: tuple[str, ...]) -> TaskID:
        self.progress.start()
        swept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in self.shape.keys] or overrides
        label = f"job {num} [cyan]{escape(' '.join(swept))}[/]"
        task = self.progress.add_task(label, total=len(stages))
        self._jobs[task] = _Job(label, stages)
        self._describe(task)
        return task

    def advance(self, task: TaskID) -> None:
        self._jobs[task].done += 1
        self._describe(task)

    def finish_job(self, task: TaskID, status: dict) -> None:
        label = self._jobs.pop(task).label
        self.progress.remove_task(task)
        self.done += 1
        if status["status"] == "ok":
            self.console.print(f"[green]✓[/] {label}: {status['output_throughput']:.1f} output tok/s, "
                               f"TTFT p99 {status['p99_ttft_ms']:.1f} ms{self._score(status, label)}")
        else:
            self.failed += 1
            lines = status["reason"].splitlines() or ["failed"]  # the full reason is in status.json
            last = f"\n    … {escape(lines[-1].strip())}" if len(lines) > 1 else ""
            self.console.print(f"[red]✗[/] {label}: {escape(lines[0])}{last}")
        if self.shape.tuning and status["status"] != "ok":
            self.console.print("    score 0")
        self.progress.advance(self.sweep)
        if self.shape.size is not None and self.done >= self.shape.size:
            self.progress.stop()
            failed = f"[red]{self.failed} failed[/]" if self.failed else "none failed"
            self.console.print(f"[bold]sweep done[/]: {self.done} job{'s' * (self.done != 1)}, {failed}")

    def _score(self, status: dict, label: str) -> str:
        if not self.shape.tuning:
            return ""
        score = float(status.get("objective", 0.0))
        if self.best is None or score > self.best[0]:
            self.best = (score, label.split(" ", 2)[1])
        note = f" ({escape(status['objective_note'])})" if status.get("objective_note") else ""
        return f"\n    score [bold]{score:.3f}[/] req/s{note}; best so far {self.best[0]:.3f} (job {self.best[1]})"
