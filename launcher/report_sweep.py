"""`llaunch-report`: the report of a benchmark sweep (`llaunch -m bench=...`), or two sweeps compared.

    llaunch-report multirun/2026-12-01/10-00-00             # table (rich + report.md) and report.png
    llaunch-report BEFORE_SWEEP AFTER_SWEEP                  # after / before ratios (rich + compare.md)

Each job directory holds status.json and bench.json (launcher/bench_job.py). The table's columns are
the overrides that vary between jobs, then request throughput, output tok/s, TTFT, TPOT, ITL and
latency percentiles, errors and (with bench.slo_*) goodput; after bench.repeats each figure is the
slowest run's with the range of all of them. The plot draws output tok/s and TTFT p99 against one
varying override (--x), one line per combination of the others, and output tok/s against latency.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.markup import escape

from llaunch.launcher.report_table import Table, to_markdown, to_rich

# (bench.json key, column, format); bench_serving writes vLLM's keys. Goodput only where a job had SLOs.
METRICS = (("request_throughput", "req/s", ".3f"), ("output_throughput", "output tok/s", ".1f"),
           ("median_ttft_ms", "TTFT median (ms)", ".1f"), ("p95_ttft_ms", "TTFT p95 (ms)", ".1f"),
           ("p99_ttft_ms", "TTFT p99 (ms)", ".1f"), ("median_tpot_ms", "TPOT median (ms)", ".2f"),
           ("p99_tpot_ms", "TPOT p99 (ms)", ".2f"), ("median_itl_ms", "ITL median (ms)", ".2f"),
           ("p95_itl_ms", "ITL p95 (ms)", ".2f"), ("median_e2el_ms", "latency median (ms)", ".0f"),
           ("p99_e2el_ms", "latency p99 (ms)", ".0f"), ("failed", "errors", ".0f"),
           ("goodput", "goodput (req/s)", ".3f"))
OPTIONAL = ("goodput",)
PLOTTED = (("output_throughput", "output tok/s"), ("p99_ttft_ms", "TTFT p99 (ms)"))


@dataclass(frozen=True)
class JobResult:
    name: str  # the job's directory name (Hydra's job number)
    overrides: dict[str, str]
    ok: bool
    reason: str
    metrics: dict[str, float]  # the headline run's (bench.repeats > 1: the slowest)
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)  # min and max over the repeats


def parse_overrides(overrides: Sequence[str]) -> dict[str, str]:
    return {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] if "=" in o else "" for o in overrides}


def load_job(job_dir: Path) -> Optional[JobResult]:
    """None when `job_dir` is not a benchmark job's directory."""
    status_path, bench_path = job_dir / "status.json", job_dir / "bench.json"
    if not status_path.exists() and not bench_path.exists():
        return None
    status = json.loads(status_path.read_text()) if status_path.exists() else {"status": "ok"}
    overrides = status.get("overrides")
    if overrides is None and (job_dir / ".hydra" / "overrides.yaml").exists():
        import yaml

        overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())
    ok = status["status"] == "ok" and bench_path.exists()
    metrics = json.loads(bench_path.read_text()) if ok else {}
    reason = status.get("reason") or ("" if ok else "no bench.json")
    runs = metrics.get("runs", []) if len(metrics.get("runs", [])) > 1 else []
    spread = {key: (min(r[key] for r in runs), max(r[key] for r in runs))
              for key, _, _ in METRICS if runs and all(key in r for r in runs)}
    return JobResult(job_dir.name, parse_overrides(overrides or []), ok, reason,
                     {key: float(metrics[key]) for key, _, _ in METRICS if key in metrics}, spread)


def load_sweep(sweep_dir: Path) -> list[JobResult]:
    """The jobs directly under `sweep_dir`, in job-number order."""
    dirs = sorted((d for d in Path(sweep_dir).iterdir() if d.is_dir()),
                  key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))
    return [job for job in map(load_job, dirs) if job is not None]


def varying_keys(jobs: Sequence[JobResult]) -> list[str]:
    keys = list(dict.fromkeys(k for job in jobs for k in job.overrides))
    return [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]


def _figure(value: Optional[float], fmt: str) -> str:
    return "—" if value is None or math.isnan(value) else format(value, fmt)


def _ratio(value: Optional[float]) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.2f}×"


def _columns(jobs: Sequence[JobResult]) -> list[tuple[str, str, str]]:
    return [m for m in METRICS if m[0] not in OPTIONAL or any(m[0] in j.metrics for j in jobs)]


def _cell(job: JobResult, key: str, fmt: str) -> str:
    """The figure, and after repeats its range: `5487.0 (5487.0–5573.0)`."""
    text = _figure(job.metrics.get(key), fmt)
    if key in job.spread and job.spread[key][0] != job.spread[key][1]:
        low, high = job.spread[key]
        text += f" ({format(low, fmt)}–{format(high, fmt)})"
    return text


def sweep_table(jobs: Sequence[JobResult]) -> Table:
    """One row per successful job: the varying overrides, then the headline figures."""
    keys, columns = varying_keys(jobs) or ["job"], _columns(jobs)
    rows = [[job.overrides.get(k, job.name if k == "job" else "") for k in keys]
            + [_cell(job, key, fmt) for key, _, fmt in columns] for job in jobs if job.ok]
    return Table(keys + [label for _, label, _ in columns], rows, len(keys))


def compare_table(before: Sequence[JobResult], after: Sequence[JobResult]) -> tuple[Table, list[str]]:
    """after / before per metric, for jobs whose varying overrides match; also what did not match."""
    keys = list(dict.fromkeys(varying_keys(before) + varying_keys(after))) or ["job"]

    def key_of(job: JobResult) -> tuple[str, ...]:
        return tuple(job.overrides.get(k, job.name if k == "job" else "") for k in keys)

    base = {key_of(job): job for job in before if job.ok}
    columns = [m for m in _columns([*before, *after]) if m[0] != "failed"]  # a ratio of error counts says little
    rows, unmatched = [], []
    for job in (j for j in after if j.ok):
        old = base.pop(key_of(job), None)
        if old is None:
            unmatched.append(f"only in after: {' '.join(f'{k}={v}' for k, v in zip(keys, key_of(job)))}")
            continue
        ratios = [job.metrics.get(m, math.nan) / old.metrics[m] if old.metrics.get(m) else None for m, _, _ in columns]
        rows.append(list(key_of(job)) + [_ratio(r) for r in ratios])
    unmatched += [f"only in before: {' '.join(f'{k}={v}' for k, v in zip(keys, key))}" for key in base]
    return Table(keys + [label for _, label, _ in columns], rows, len(keys)), unmatched


def _as_number(value: str) -> Optional[float]:
    try:
        return float(value)
    except ValueError:
        return None


def plot_sweep(jobs: Sequence[JobResult], path: Path, x_key: Optional[str] = None) -> Path:
    """Output tok/s and TTFT p99 against `x_key` (default: the first numeric varying override), one
    line per combination of the other varying overrides."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    ok = [job for job in jobs if job.ok]
    keys = varying_keys(jobs)
    if x_key is None:
        numeric = [k for k in keys if all(_as_number(j.overrides.get(k, "")) is not None for j in ok)]
        x_key = (numeric or keys or ["job"])[0]
    others = [k for k in keys if k != x_key]

    def x_of(job: JobResult) -> str:
        return job.name if x_key == "job" else job.overrides.get(x_key, "")

    categories = list(dict.fromkeys(x_of(j) for j in ok))
    numeric_x = all(_as_number(c) is not None for c in categories)
    lines: dict[str, list[JobResult]] = {}
    for job in ok:
        lines.setdefault(", ".join(f"{k}={job.overrides.get(k, '')}" for k in others), []).append(job)
    fig, axes = plt.subplots(1, len(PLOTTED) + 1, figsize=(5.5 * (len(PLOTTED) + 1), 4), squeeze=False)
    for ax, (metric, label) in zip(axes[0], PLOTTED):
        for name, members in lines.items():
            points = sorted((_as_number(x_of(j)) if numeric_x else categories.index(x_of(j)), j.metrics[metric])
                            for j in members if metric in j.metrics)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name or None)
        if not numeric_x:
            ax.set_xticks(range(len(categories)), categories)
        ax.set_xlabel(x_key)
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs {x_key}")
        ax.grid(alpha=0.3)
        if any(lines):
            ax.legend(fontsize="small")
    _plot_tradeoff(axes[0][-1], lines, x_of, x_key)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_tradeoff(ax, lines: dict[str, list[JobResult]], x_of, x_key: str) -> None:
    """Output tok/s against median request latency: what each setting of `x_key` trades."""
    for name, members in lines.items():
        points = sorted((j.metrics["median_e2el_ms"] / 1000, j.metrics["output_throughput"], x_of(j))
                        for j in members if "median_e2el_ms" in j.metrics and "output_throughput" in j.metrics)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name or None)
        for latency, throughput, x in points:
            ax.annotate(x, (latency, throughput), textcoords="offset points", xytext=(4, 4), fontsize="small")
    ax.set_xlabel("latency median (s)")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"throughput vs latency (points: {x_key})")
    ax.grid(alpha=0.3)
    if any(lines):
        ax.legend(fontsize="small")


def _failed_lines(jobs: Sequence[JobResult]) -> list[str]:
    return [f"job {job.name} ({' '.join(f'{k}={v}' for k, v in job.overrides.items())}): "
            f"{job.reason.splitlines()[0] if job.reason else 'failed'}" for job in jobs if not job.ok]


def report(sweep_dir: Path, out_dir: Path, console: Console, x_key: Optional[str] = None) -> int:
    jobs = load_sweep(sweep_dir)
    if not jobs:
        console.print(f"[red]no benchmark jobs under {escape(str(sweep_dir))}[/] (job dirs hold status.json)")
        return 1
    table, failed = sweep_table(jobs), _failed_lines(jobs)
    console.print(to_rich(table, f"sweep {sweep_dir}"))
    markdown = f"# Sweep `{sweep_dir}`\n\n{to_markdown(table)}"
    if failed:
        console.print(f"[red]{len(failed)} failed job(s)[/]:\n" + "\n".join(f"  ✗ {escape(f)}" for f in failed))
        markdown += "\nFailed jobs:\n\n" + "".join(f"- {f}\n" for f in failed)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(markdown)
    written = [out_dir / "report.md"]
    if table.rows:
        written.append(plot_sweep(jobs, out_dir / "report.png", x_key))
    console.print("wrote " + ", ".join(escape(str(p)) for p in written))
    return 0 if table.rows else 1


def compare(before_dir: Path, after_dir: Path, out_dir: Path, console: Console) -> int:
    table, unmatched = compare_table(load_sweep(before_dir), load_sweep(after_dir))
    title = f"after / before: {after_dir} vs {before_dir}"
    console.print(to_rich(table, title))
    for line in unmatched:
        console.print(f"[yellow]{escape(line)}[/]")
    note = "Ratios are after / before: above 1 is better for throughput, below 1 for latency.\n"
    markdown = f"# {title}\n\n{note}\n{to_markdown(table)}" + "".join(f"\n- {u}" for u in unmatched)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.md").write_text(markdown + ("\n" if unmatched else ""))
    console.print(f"wrote {escape(str(out_dir / 'compare.md'))}")
    return 0 if table.rows else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="llaunch-report", description=__doc__.split("\n")[0])
    ap.add_argument("sweeps", nargs="+", type=Path, metavar="SWEEP_DIR",
                    help="one sweep directory, or two (before, after) to compare")
    ap.add_argument("--out", type=Path, default=None, help="where to write (default: the (after) sweep directory)")
    ap.add_argument("--x", default=None, help="the override on the plot's x axis (default: the first numeric one)")
    args = ap.parse_args(argv)
    if len(args.sweeps) > 2:
        ap.error("give one sweep directory, or two (before, after)")
    for d in args.sweeps:
        if not d.is_dir():
            ap.error(f"{d} is not a directory")
    console = Console()
    if not console.is_terminal:  # piped: wide enough that no column name is cropped
        console = Console(width=1000)
    if len(args.sweeps) == 1 and (args.sweeps[0] / "study.db").exists():  # a tuning sweep (hydra/sweeper=tune)
        from llaunch.launcher import tune_report

        return tune_report.report_dir(args.sweeps[0], console)
    if len(args.sweeps) == 1:
        return report(args.sweeps[0], args.out or args.sweeps[0], console, args.x)
    return compare(args.sweeps[0], args.sweeps[1], args.out or args.sweeps[1], console)
