"""One benchmark job of a sweep (`llaunch -m bench=c64 router.max_running_requests=64,128`).

A job whose config has a `bench` profile does not serve forever: it serves its own config in a
subprocess (launcher/bench_server.py), waits for /health, runs scripts/bench_serving.py with the bench
profile's settings, stops the server (SIGTERM: drain) and waits until its port is free. It writes
into the job's directory:

    config.yaml   the server's resolved run config        server.log, server/ (its run dir and logs)
    bench.json    bench_serving's result (vLLM's keys)    bench.log (its table and errors)
    status.json   {"status": "ok" | "failed", "reason": ..., "overrides": [...], "seconds": {...}, ...}

A failing job (bad config, crash, timeout) is recorded with its reason and the sweep goes on.
Timeouts: bench.ready_timeout_s (server start, default 900 s) and bench.timeout_s (the benchmark,
default 3600 s).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from llaunch.launcher import config_changes, gpus, secrets, tune_objective
from llaunch.launcher.bench_server import JobFailed, ServerProcess, die_with_parent, tail, wait_port_free
from llaunch.runtime.config import BenchConfig, BenchLengths, Device, LlaunchConfig, RunConfig
from llaunch.launcher.store import REPO_ROOT
from llaunch.launcher.sweep_progress import SweepProgress, output_root

BENCH_SCRIPT = REPO_ROOT / "scripts" / "bench_serving.py"
PORT_FREE_TIMEOUT_S = 30.0
# Launchers that run one job at a time (basic) or place GPUs themselves (submitit: Slurm's allocation):
# every other launcher (joblib, ...) runs jobs side by side on this host, so each job gets its own GPUs.
SELF_PLACING_LAUNCHERS = ("BasicLauncher", "submitit")
STAGES = ("start server", "wait for /health", "benchmark", "stop server")
logging.getLogger("httpx").setLevel(logging.WARNING)  # Hydra's job logging would log every /health poll


class BenchJobFailed(Exception):
    """Raised by a failed job so that Hydra marks it failed; picklable, so parallel launchers return it."""

    def __init__(self, output_dir: str):
        super().__init__(output_dir)
        self.output_dir = output_dir  # the sweep's directory (or the single job's)


def failed_jobs(output_dir: str) -> int:
    """How many jobs under a sweep (or run) directory recorded a failure."""
    return sum(json.loads(p.read_text()).get("status") != "ok" for p in Path(output_dir).rglob("status.json"))


@dataclass(frozen=True)
class BenchJob:
    job_dir: Path
    num: int  # Hydra's job index in the sweep
    overrides: list[str]  # the job's own overrides (`hydra.overrides.task`)
    shares_host: bool  # jobs run side by side on this host (e.g. hydra/launcher=joblib)


def job_gpus(num: int, gpus_per_job: int, visible: list[str]) -> list[str]:
    """Job `num`'s share of the host's GPUs: slot num % (GPUs // GPUs per job)."""
    slots = len(visible) // gpus_per_job
    if slots == 0:
        raise JobFailed(f"the job needs {gpus_per_job} GPUs (parallel.tp × parallel.dp); {len(visible)} visible")
    slot = num % slots
    return visible[slot * gpus_per_job:(slot + 1) * gpus_per_job]


def _uses_cuda(device: Device) -> bool:
    if device == Device.auto:
        return gpus.visible_count() > 0
    return device == Device.cuda


def server_env(job: BenchJob, cfg: LlaunchConfig) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("HYDRA_FULL_ERROR", None)  # set by our own main(); the server reports config errors itself
    if job.shares_host and _uses_cuda(cfg.device):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(job_gpus(job.num, cfg.parallel.tp * cfg.parallel.dp, gpus.visible_ids()))
    return env


def bench_command(bench: BenchConfig, cfg: RunConfig, result_file: Path, seed: int = 0) -> list[str]:
    args = {"base-url": cfg.graph.http_url, "model": cfg.model.name, "num-prompts": bench.num_prompts,
            "input-len": bench.input_len, "output-len": bench.output_len, "concurrency": bench.concurrency,
            "request-rate": bench.request_rate, "warmup": bench.warmup, "vocab-size": cfg.model.vocab_size,
            "result-file": result_file,
            "shared-prefix-groups": bench.shared_prefix_groups or None,
            "shared-prefix-len": bench.shared_prefix_len or None,
            "multi-turn": bench.multi_turn if bench.multi_turn != 1 else None,
            "client-procs": bench.client_procs if bench.client_procs != 1 else None,
            "seed": seed or None, "slo-ttft-ms": bench.slo_ttft_ms, "slo-tpot-ms": bench.slo_tpot_ms,
            "trace": Path(bench.trace).expanduser().resolve() if bench.trace else None,
            "lengths": bench.lengths.value if bench.lengths != BenchLengths.fixed else None,
            "max-model-len": cfg.model.max_model_len if bench.lengths != BenchLengths.fixed else None}
    return [sys.executable, str(BENCH_SCRIPT), *(f"--{k}={v}" for k, v in args.items() if v is not None)]


API_KEY_VARIABLE = "LLAUNCH_API_KEY"  # bench_serving.py reads the key from it (a secret: not on its command line)


# every repeat's figures kept in bench.json's "runs" (the report's spread)
RUN_FIGURES = ("output_throughput", "request_throughput", "median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms",
               "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p95_itl_ms", "median_e2el_ms", "p99_e2el_ms",
               "failed", "completed", "goodput", "good_requests", "prefix_cache_hit_rate")
SEED_STRIDE = 1000  # repeat k runs seed k * SEED_STRIDE: its prompts and warm-up differ from every other run's


def run_bench(job_dir: Path, bench: BenchConfig, cfg: RunConfig, api_key: Optional[str] = None) -> dict:
    """bench.repeats runs on fresh prompts; bench.json is the slowest (the headline) with every run's figures."""
    runs = [_run_once(job_dir, bench, cfg, api_key, k) for k in range(bench.repeats)]
    headline = min(runs, key=lambda r: r["output_throughput"])
    result = {**headline, "repeats": bench.repeats,
              "runs": [{k: r[k] for k in RUN_FIGURES if k in r} for r in runs]}
    (job_dir / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _run_once(job_dir: Path, bench: BenchConfig, cfg: RunConfig, api_key: Optional[str], repeat: int) -> dict:
    result_file, log_path = job_dir / "bench.json", job_dir / ("bench.log" if repeat == 0 else f"bench.{repeat}.log")
    result_file.unlink(missing_ok=True)
    command = bench_command(bench, cfg, result_file, seed=repeat * SEED_STRIDE)
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=bench.timeout_s, preexec_fn=die_with_parent,
                                  env=dict(os.environ, COLUMNS="120", **({API_KEY_VARIABLE: api_key} if api_key else {})))
        except subprocess.TimeoutExpired:
            raise JobFailed(f"the benchmark did not finish within {bench.timeout_s:.0f} s "
                            "(bench.timeout_s)") from None
    if proc.returncode != 0 or not result_file.exists():
        raise JobFailed(f"the benchmark exited with code {proc.returncode}:\n{tail(log_path, 3)}")
    result = json.loads(result_file.read_text())
    if result["failed"]:
        first = next(r["error"] for r in result["requests"] if not r["success"])
        raise JobFailed(f"{result['failed']} of {result['failed'] + result['completed']} requests failed; "
                        f"first error: {first}")
    return result


def run(job: BenchJob, cfg: LlaunchConfig, progress: SweepProgress) -> dict:
    """Serve, benchmark, stop; returns the job's status record (also written to status.json)."""
    job.job_dir.mkdir(parents=True, exist_ok=True)
    task = progress.start_job(job.num, job.overrides, STAGES)
    t0 = time.monotonic()
    ready_s = cfg.bench.ready_timeout_s
    deadline, timeout_name = t0 + ready_s, f"{ready_s:.0f} s (bench.ready_timeout_s)"
    status: dict = {"status": "failed", "reason": "", "overrides": job.overrides, "job_num": job.num,
                    "seconds": {}}  # when each stage ended, from the job's start

    def stage_done(name: str) -> None:
        status["seconds"][name] = round(time.monotonic() - t0, 3)
        progress.advance(task)

    server: Optional[ServerProcess] = None
    run_cfg: Optional[RunConfig] = None
    try:
        server = ServerProcess(job.job_dir, job.overrides, server_env(job, cfg))
        status["server_pid"] = server.proc.pid
        run_cfg = server.wait_config(deadline, timeout_name)
        shutil.copyfile(server.run_dir / "config.yaml", job.job_dir / "config.yaml")
        status["http_url"] = run_cfg.graph.http_url
        stage_done("planned")
        server.wait_healthy(run_cfg.graph.http_url, deadline, timeout_name)
        stage_done("healthy")
        try:
            result = run_bench(job.job_dir, cfg.bench, run_cfg, secrets.api_key(cfg))
        finally:
            server.check_alive("during the benchmark")  # a crash explains a failed benchmark best
        status.update(status="ok", output_throughput=result["output_throughput"], p99_ttft_ms=result["p99_ttft_ms"])
        status["objective"], note = tune_objective.objective(cfg.bench, result)
        if note:
            status["objective_note"] = note
        stage_done("benchmarked")
    except JobFailed as e:
        status["reason"] = str(e)
    except KeyboardInterrupt:
        status["reason"] = "interrupted"
        raise
    except Exception as e:  # a launcher bug still fails only this job
        status["reason"] = f"{type(e).__name__}: {e}"
    finally:
        if server is not None:
            _stop(server, run_cfg, status)
        status["seconds"]["stopped"] = round(time.monotonic() - t0, 3)
        write_status(job.job_dir, status)
        progress.finish_job(task, status)
    return status


def _stop(server: ServerProcess, run_cfg: Optional[RunConfig], status: dict) -> None:
    """Stop the server and wait for its port; a failure here fails a job that had passed so far."""
    failure = server.stop(run_cfg.server.drain_timeout_s if run_cfg else 60.0)
    status["server_exit_code"] = server.proc.returncode
    if failure is None and run_cfg is not None and not wait_port_free(run_cfg.server.host, run_cfg.server.port,
                                                                      PORT_FREE_TIMEOUT_S):
        failure = f"port {run_cfg.server.port} still in use {PORT_FREE_TIMEOUT_S:.0f} s after the server stopped"
    if failure and status["status"] == "ok":
        status.update(status="failed", reason=failure)


def write_status(job_dir: Path, status: dict) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "status.json").write_text(json.dumps(status, indent=2) + "\n")


def tuning(hydra_cfg) -> bool:
    """Is this job a trial of a tuning sweep (hydra/sweeper=tune)? Its score goes back to Optuna."""
    from omegaconf import OmegaConf

    return "llaunch_tune" in str(OmegaConf.select(hydra_cfg, "sweeper._target_", default=""))


def bench_refusals(cfg: LlaunchConfig, changed: dict) -> list[str]:
    """The rules over the bench group, which the job's server never sees (its overrides lose bench.*;
    it checks the rest itself): the benchmark's settings, and bench keys that have no effect."""
    from llaunch.launcher import rules, rules_effect

    found = rules.bench_settings_valid(cfg) + rules_effect.keys_have_effect(
        cfg, {k: v for k, v in changed.items() if k.startswith("bench.")})
    return [v.message for v in found]


def run_from_hydra(dict_cfg, hydra_cfg) -> Optional[float]:
    """The `llaunch` task function's branch for a config with a bench profile. A trial of a tuning sweep
    returns its score (0.0 when it failed: the study goes on); any other failed job raises BenchJobFailed."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    job = BenchJob(job_dir=Path(hydra_cfg.runtime.output_dir),
                   num=int(OmegaConf.select(hydra_cfg, "job.num", default=0) or 0),
                   overrides=list(hydra_cfg.overrides.task),
                   shares_host=not any(name in str(hydra_cfg.launcher._target_) for name in SELF_PLACING_LAUNCHERS))
    progress = SweepProgress.shared(hydra_cfg)
    try:
        cfg = OmegaConf.to_object(dict_cfg)
        refused = bench_refusals(cfg, config_changes.of_job(cfg, hydra_cfg))
    except OmegaConfBaseException as e:
        refused = [str(e)]
    if refused:
        status = {"status": "failed", "reason": f"invalid configuration: {'; '.join(refused)}",
                  "overrides": job.overrides, "job_num": job.num}
        write_status(job.job_dir, status)
        progress.finish_job(progress.start_job(job.num, job.overrides, STAGES), status)
    else:
        status = run(job, cfg, progress)
    if tuning(hydra_cfg):
        return float(status.get("objective", 0.0)) if status["status"] == "ok" else 0.0
    if status["status"] != "ok":
        raise BenchJobFailed(str(output_root(hydra_cfg)))
    return None
