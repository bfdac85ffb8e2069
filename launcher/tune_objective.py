"""A tuning trial's score (`llaunch -m hydra/sweeper=tune`): goodput, requests per second that met the
bench profile's SLOs, the lowest over its bench.repeats runs; a run where fewer than
bench.slo_percentile % of the requests met them scores 0. Without SLOs every completed request counts
(request throughput). A failed job (a broken rule, a crash, a timeout) scores 0 and keeps its reason."""
from __future__ import annotations

from llaunch.runtime.config import BenchConfig


def run_score(bench: BenchConfig, run: dict) -> tuple[float, str]:
    """One run's goodput and, when it is 0 by the percentile, why."""
    if bench.slo_ttft_ms is None and bench.slo_tpot_ms is None:
        return float(run["request_throughput"]), ""
    total = run.get("completed", 0) + run.get("failed", 0)
    met = 100.0 * run.get("good_requests", 0) / total if total else 0.0
    if bench.slo_percentile is not None and met < bench.slo_percentile:
        return 0.0, f"{met:.1f}% of requests met the SLOs, under bench.slo_percentile={bench.slo_percentile:g}"
    return float(run["goodput"]), ""


def objective(bench: BenchConfig, result: dict) -> tuple[float, str]:
    """bench.json's runs → the trial's score (the lowest run's) and a note when a run scored 0."""
    scores = [run_score(bench, run) for run in result.get("runs") or [result]]
    return min(scores, key=lambda s: s[0])
