"""The `llaunch` command: compose profiles (Hydra) → derive → check every rule → plan the process graph →
write {run_dir}/config.yaml → print the graph (dry run) or start and supervise it.

A config with a `bench` profile runs a benchmark job instead of serving (launcher/bench_job.py).

Exit codes: 0 ok; 2 the configuration is invalid (composition error or violated rules; nothing
started); otherwise the serving graph's own status (launcher/supervise.py). Benchmark jobs (a sweep):
the number of failed jobs, capped at 255.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Optional

import hydra
import msgspec
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llaunch.launcher import (bench_job, cli_help, config_changes, config_keys, derive, host_checks, memory_plan, plan,
                              ports, report, rules, secrets, store)
from llaunch.runtime.config import Device, LlaunchConfig, RunConfig

EXIT_INVALID = 2
store.register()  # before Hydra composes: the profiles name these schemas and the models_dir resolver
try:  # hydra/sweeper=tune (conf/hydra/sweeper/tune.yaml): builds on the Optuna sweeper plugin
    from llaunch.launcher import tune_sweeper
except ImportError:
    tune_sweeper = None
else:
    tune_sweeper.register()
_job_started = False  # Hydra exits 1 on composition errors, before the job; we make those exit 2


def run_config_of(cfg: LlaunchConfig, run_dir: Path, graph) -> RunConfig:
    return RunConfig(**{f.name: getattr(cfg, f.name) for f in fields(LlaunchConfig)}, run_dir=str(run_dir),
                     graph=graph, draft_model=derive.resolve_draft(cfg))


def write_run_config(run_config: RunConfig) -> Path:
    """The one frozen file every child process reads (runtime/bootstrap.py load_run_config)."""
    path = Path(run_config.run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.yaml.encode(run_config))
    return path


def launch(composed: LlaunchConfig, run_dir: Path, changed: Mapping[str, Any] = rules.NOTHING_CHANGED) -> int:
    """Everything after composition; returns the exit code. `changed`: the keys the user set away from
    the profiles' values, with those values (launcher/config_changes.py): each must have an effect."""
    try:
        cfg = derive.resolve(composed)
    except derive.CheckpointError as e:
        report.print_error("cannot read the checkpoint", str(e))  # the message names the key
        return EXIT_INVALID
    violations = rules.check_all(cfg, changed)
    if violations:
        report.print_violations(violations)
        return EXIT_INVALID
    shm = host_checks.shm_warning(cfg)
    if shm:
        report.err.print(f"[yellow]warning[/]: {shm}", markup=True, highlight=False)
    for stale in ports.remove_stale_ipc_dirs():
        report.err.print(f"[dim]removed {stale}: the ipc directory of a launcher that is gone[/]")
    key = secrets.api_key(cfg)
    secrets.scrub(run_dir, key)
    endpoints = plan.endpoints_for(cfg)
    try:
        cfg = plan.choose_server_port(cfg, endpoints)
        run_config = run_config_of(secrets.redacted(cfg), run_dir, plan.plan_graph(cfg, endpoints))
        write_run_config(run_config)
        if cfg.dry_run:
            if composed.device == Device.auto and cfg.device == Device.cpu:
                report.err.print("[dim]device=auto is cpu on this machine; pass device=cuda to plan GPUs[/]")
            report.print_dry_run_notes(rules.warnings(cfg), rules.pending(cfg))
            memory = memory_plan.summary(cfg)
            if memory:
                report.err.print(f"[dim]{memory}[/]")
            report.print_graph(run_config)
            if Path(run_dir).name.startswith("llaunch-dry-run-"):
                report.err.print("[dim]a dry run writes nothing; name hydra.run.dir=... to keep its config.yaml[/]")
            return 0
        from llaunch.launcher.supervise import run_graph  # imports zmq and the runtime: only when serving

        endpoints.handover()  # children bind the reserved ports from here on
        return run_graph(run_config, api_key=key)
    finally:
        endpoints.close()


@hydra.main(version_base="1.3", config_path=str(store.CONF_DIR), config_name="config")
def _hydra_app(dict_cfg: DictConfig) -> Optional[float]:
    global _job_started
    _job_started = True
    from hydra.core.hydra_config import HydraConfig

    if dict_cfg.bench is not None and not dict_cfg.dry_run:
        # Hydra marks a job failed when it raises, runs the sweep's other jobs, then re-raises in main();
        # a tuning trial returns its score to the Optuna sweeper instead (launcher/tune_sweeper.py)
        return bench_job.run_from_hydra(dict_cfg, HydraConfig.get())
    unknown = unknown_override_keys(HydraConfig.get().overrides.task)
    if unknown:  # `+key=value` gets past composition, then fails against the frozen schema
        report.print_error("invalid configuration", "\n".join(config_keys.unknown_key_message(k) for k in unknown))
        sys.exit(EXIT_INVALID)
    try:
        composed = OmegaConf.to_object(dict_cfg)
    except OmegaConfBaseException as e:
        report.print_error("invalid configuration", str(e))
        sys.exit(EXIT_INVALID)
    code = launch(composed, Path(HydraConfig.get().runtime.output_dir), config_changes.of_job(composed, HydraConfig.get()))
    if code:  # on success return to Hydra, so a -m sweep goes on to its next job
        sys.exit(code)


def unknown_override_keys(overrides) -> list[str]:
    """Keys of `key=value` overrides that the schema does not have (group choices and hydra.* aside)."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    return [k for k in keys if not k.startswith("hydra.") and "@" not in k and "/" not in k
            and k not in (*store.GROUPS, "tuned") and config_keys.unknown(k)]


def _composition_error(e: Exception) -> str:
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else None
    text = str(e) or type(e).__name__
    if isinstance(e, OverrideParseException) and getattr(e, "override", None):
        return _override_parse_error(e.override, text)
    if tune_sweeper is None and "tune_schema" in f"{text}\n{cause}":
        return "hydra/sweeper=tune needs the tuning extra (Optuna): pip install 'llaunch[tune]'"
    full_key = re.search(r"full_key: (\S+)", f"{text}\n{cause}")
    if full_key and config_keys.unknown(full_key.group(1)):  # Hydra's hint (`+key=...`) would not help
        return config_keys.unknown_key_message(full_key.group(1))
    if not isinstance(e, HydraException):  # OmegaConf asserts when an override dives into a null group
        text += "\n(overriding a key of an optional group needs the group chosen first, e.g. bench=c64)"
    return f"{text}\n{cause}" if cause is not None and str(cause) not in text else text


def _override_parse_error(override: str, text: str) -> str:
    """Hydra's grammar error names no override; a value holding '=' (kernels.gemv_shapes' NxK=shape) or a character
    of the grammar parses only quoted whole, inside the shell's quotes."""
    key, sep, value = override.partition("=")
    hint = ""
    if sep and value and not value.startswith(("'", '"')):
        hint = f"\n(a value holding '=', ':', spaces or brackets is quoted whole: \"{key}='{value}'\")"
    return f"{text}{hint}" if override in text else f"{override}: {text}{hint}"


def _scratch_run_dir(argv: list[str]) -> Optional[str]:
    """A plain dry run writes nothing: Hydra's run directory goes to a temporary one, removed after
    (unless the command names hydra.run.dir, where the run config is then kept)."""
    if "-m" in argv or "--multirun" in argv or not any(a.lower() == "dry_run=true" for a in argv):
        return None
    if any(a.startswith("hydra.run.dir=") for a in argv):
        return None
    scratch = tempfile.mkdtemp(prefix="llaunch-dry-run-")
    argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null"]
    return scratch


def main() -> None:
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(cli_help.render())
        return
    if "--version" in sys.argv[1:]:
        print(f"llaunch {cli_help.version()}")
        return
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing: we report composition errors
    scratch = _scratch_run_dir(sys.argv)
    try:
        _hydra_app()
    except bench_job.BenchJobFailed as e:  # every job has run; each recorded its outcome in status.json
        failed = bench_job.failed_jobs(e.output_dir)
        report.err.print(f"[red]{failed} benchmark job(s) failed[/]: reasons in status.json under {e.output_dir}")
        raise SystemExit(min(failed, 255)) from None
    except SystemExit as e:
        if e.code == 1 and not _job_started:
            raise SystemExit(EXIT_INVALID) from None
        raise
    except Exception as e:
        if _job_started or full_error:
            raise  # a launcher bug: keep the traceback
        report.print_error("invalid configuration", _composition_error(e))
        raise SystemExit(EXIT_INVALID) from None
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
