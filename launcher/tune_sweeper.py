"""`llaunch -m hydra/sweeper=tune bench=... 'router.max_running_requests=int(interval(32,512))' ...`: a
tuning sweep, Hydra's Optuna sweeper (TPE by default; hydra/sweeper/sampler=random|grid) maximizing
each trial's goodput (launcher/tune_objective.py), with three changes for serving studies:

- the study lives in a storage by default (sqlite:///<sweep dir>/study.db): a rerun of the same command
  (same hydra.sweep.dir, or the same storage URL and study_name) continues the study;
- n_trials is the study's total: a rerun runs only the trials still missing, and trial k's job
  directory is <sweep dir>/k (Optuna's trial number), so a resumed study never overwrites a trial;
- after the study, launcher/tune_report.py writes the best config as a profile
  (<tuned_dir>/tuned/<study_name>.yaml, `llaunch --config-dir <tuned_dir> +tuned=<study_name>`),
  a table of trials and plots.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper.config import Direction, OptunaSweeperConf
from omegaconf import DictConfig

log = logging.getLogger(__name__)
INTERRUPTED = "llaunch_interrupted"  # a trial's user attribute: cut short by an interruption, replaced


@dataclass
class TuneSweeperConf(OptunaSweeperConf):
    """conf/hydra/sweeper/tune.yaml's schema: Optuna's sweeper keys, our defaults, and where the profile goes."""

    _target_: str = "hydra_plugins.llaunch_tune.TuneSweeper"
    direction: Any = Direction.maximize
    study_name: Optional[str] = "llaunch-tune"
    n_trials: int = 20
    n_jobs: int = 1
    max_failure_rate: float = 1.0
    tuned_dir: Optional[str] = None


def register() -> None:
    """The schema for conf/hydra/sweeper/tune.yaml, and the sweeper's class for Hydra (which finds plugins
    by scanning the hydra_plugins namespace: an editable install is not on its path)."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    from hydra_plugins.llaunch_tune import TuneSweeper

    ConfigStore.instance().store(group="hydra/sweeper", name="tune_schema", node=TuneSweeperConf, provider="llaunch")
    Plugins.instance().register(TuneSweeper)


class Tuner(Sweeper):
    """hydra_plugins.llaunch_tune.TuneSweeper: Hydra takes sweepers from the hydra_plugins package only."""

    def __init__(self, sampler, direction, storage, study_name, n_trials, n_jobs, max_failure_rate, search_space,
                 custom_search_space, params, tuned_dir: Optional[str] = None) -> None:
        from llaunch.launcher import tune_report

        tune_report.quiet_optuna_imports()  # the Optuna sweeper imports optuna
        from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

        self.impl = OptunaSweeperImpl(sampler, direction, storage, study_name, n_trials, n_jobs, max_failure_rate,
                                      search_space, custom_search_space, params)
        self.total = n_trials
        self.tuned_dir = tuned_dir

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.config = config

    def sweep(self, arguments: List[str]) -> None:
        import optuna

        from llaunch.launcher import tune_report
        from llaunch.launcher.sweep_progress import SweepProgress, SweepShape

        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        own_storage = self.impl.storage is None  # this sweep's alone: no other worker runs its trials
        if own_storage:
            self.impl.storage = f"sqlite:///{sweep_dir / 'study.db'}"
        study = optuna.create_study(study_name=self.impl.study_name, storage=self.impl.storage,
                                    directions=self.impl._get_directions(), load_if_exists=True)
        if own_storage:
            for number in fail_interrupted(study):
                log.warning(f"trial {number} was cut short by an interruption: marked failed, a new trial replaces it")
        finished = sum(t.state.is_finished() and not t.user_attrs.get(INTERRUPTED) for t in study.trials)
        self.impl.n_trials = max(0, self.total - finished)
        self.impl.job_idx = len(study.trials)  # job directory k is trial k (one worker: numbers are consecutive)
        if finished:
            log.info(f"study {study.study_name}: {finished} trial(s) done, {self.impl.n_trials} to go")
        keys = tuple(a.split("=", 1)[0] for a in [*self.impl._parse_sweeper_params_config(), *arguments]
                     if _is_search_space(a))
        progress = SweepProgress._shared = SweepProgress(SweepShape(self.total, keys, tuning=True), done=finished)
        scored = [t for t in study.trials if t.value is not None]
        if scored:  # a resumed study: its best so far
            best = max(scored, key=lambda t: t.value)
            progress.best = (best.value, str(best.number))
        if self.impl.n_trials:
            self.impl.sweep(arguments)
        study = optuna.load_study(study_name=study.study_name, storage=self.impl.storage)
        tune_report.write(study, sweep_dir, Path(self.tuned_dir) if self.tuned_dir else sweep_dir)


def fail_interrupted(study) -> list[int]:
    """Mark the trials still RUNNING (the sweep that ran them was killed) failed; their numbers."""
    from optuna.trial import TrialState

    stale = [t for t in study.trials if t.state == TrialState.RUNNING]
    for t in stale:  # optuna 2.10 has no public call for either
        study._storage.set_trial_user_attr(t._trial_id, INTERRUPTED, True)  # not counted in n_trials
        study._storage.set_trial_state(t._trial_id, TrialState.FAIL)
    return [t.number for t in stale]


def _is_search_space(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_override(override)
    return parsed.is_sweep_override() and not parsed.is_hydra_override()
