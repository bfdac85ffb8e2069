"""Tuning sweeps as a user runs them: `llaunch -m hydra/sweeper=tune bench=... <search space>` runs an
Optuna study whose trials serve and benchmark a config each; a trial that breaks a rule scores 0 and
the study goes on; the best config becomes a profile that serves; a rerun continues the study."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import optuna
import pytest
import yaml
from openai import OpenAI

from integration.server import LlaunchServer
from integration.test_sweep import TINY, llaunch, status_of, sweep_report

pytestmark = pytest.mark.timeout(900)

# chunked_prefill_size=1024 breaks router.batch_max_tokens=512 (rule batch_max_tokens_bounds): scored 0
SPACE = ["router.batch_max_tokens=512", "router.max_running_requests=int(interval(1,8))",
         "router.chunked_prefill_size=choice(256,1024)"]
TUNE = ["-m", "hydra/sweeper=tune", "hydra.sweeper.study_name=smoke", "bench=tune_smoke", *TINY, *SPACE]


def trials_of(sweep: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="smoke", storage=f"sqlite:///{sweep / 'study.db'}").trials


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    """Six trials over two parameters, the profile written to a directory of the user's choice."""
    root = tmp_path_factory.mktemp("tune")
    sweep, profiles = root / "sweep", root / "profiles"
    r = llaunch(root, *TUNE, "hydra.sweeper.n_trials=6", f"hydra.sweep.dir={sweep}",
                f"hydra.sweeper.tuned_dir={profiles}", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return root


def test_a_study_scores_broken_trials_0_and_writes_a_profile_that_serves(study, tmp_path):
    sweep, profiles = study / "sweep", study / "profiles"
    trials = trials_of(sweep)
    assert len(trials) == 6 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    broken = [t for t in trials if t.params["router.chunked_prefill_size"] == 1024]
    served = [t for t in trials if t.params["router.chunked_prefill_size"] == 256]
    assert broken and served  # the seeded sampler draws both
    for t in broken:  # job directory k is trial k; the rule's message is kept
        status = status_of(sweep / str(t.number))
        assert t.value == 0.0 and status["status"] == "failed" and "invalid configuration" in status["reason"]
        assert "router.chunked_prefill_size=1024" in status["reason"]
    for t in served:  # the score is bench.json's goodput, every request within the loose SLOs
        status = status_of(sweep / str(t.number))
        bench = json.loads((sweep / str(t.number) / "bench.json").read_text())
        assert status["status"] == "ok" and f"router.max_running_requests={t.params['router.max_running_requests']}" \
            in status["overrides"]
        assert bench["good_requests"] == bench["completed"] == 4
        assert t.value == pytest.approx(bench["goodput"]) and t.value > 0
    best = max(trials, key=lambda t: t.value)

    profile_path = profiles / "tuned" / "smoke.yaml"
    profile = yaml.safe_load(profile_path.read_text())
    assert profile["router"] == {"batch_max_tokens": 512, **{k.split(".")[1]: v for k, v in best.params.items()}}
    assert profile["defaults"] == [{"override /model": "tiny-qwen2"}] and profile["device"] == "cpu"
    assert "bench" not in profile and "hydra" not in profile
    rows = [line.split("|")[1].strip() for line in (sweep / "tune.md").read_text().splitlines()
            if line.startswith("| ")]
    assert rows[0] == "trial" and rows[-6:] == [str(n) for n in range(6)]  # one row per trial
    image = matplotlib.image.imread(sweep / "tune.png")
    assert image.ndim == 3 and image.shape[1] > 600 and image.std() > 0

    # the profile, as the report says to use it: it serves
    with LlaunchServer(["--config-dir", str(profiles), "+tuned=smoke"], run_dir=tmp_path / "run") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        done = client.completions.create(model="tiny-qwen2", prompt="Hello", max_tokens=4, temperature=0.0)
        assert done.usage.completion_tokens == 4
        resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
        assert resolved["router"]["max_running_requests"] == best.params["router.max_running_requests"]
        assert resolved["router"]["chunked_prefill_size"] == best.params["router.chunked_prefill_size"]


def test_a_rerun_continues_the_study_from_its_sqlite_file(study, tmp_path):
    """Resumed under hydra/launcher=submitit_local: each trial a submitit job (a Slurm job with
    hydra/launcher=slurm), its score returned to the sweeper."""
    sweep = tmp_path / "sweep"
    shutil.copytree(study / "sweep", sweep)
    before = [(t.number, t.params, t.value) for t in trials_of(sweep)]
    statuses = {n: (sweep / str(n) / "status.json").read_text() for n in range(6)}
    # n_trials is the study's total: the same command with a larger total runs only the missing trials
    r = llaunch(tmp_path, *TUNE, "hydra/launcher=submitit_local", "hydra.sweeper.n_trials=8",
                f"hydra.sweep.dir={sweep}", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (sweep / ".submitit").is_dir()
    after = trials_of(sweep)
    assert [(t.number, t.params, t.value) for t in after[:6]] == before and len(after) == 8
    assert {n: (sweep / str(n) / "status.json").read_text() for n in range(6)} == statuses  # none re-run
    for t in after[6:]:
        status = status_of(sweep / str(t.number))
        assert status["job_num"] == t.number and t.value == (status.get("objective", 0.0))
    assert (sweep / "tuned" / "smoke.yaml").exists()  # the default place: the sweep directory
    # a study that already holds its n_trials runs none and reports again
    r = llaunch(tmp_path, *TUNE, "hydra.sweeper.n_trials=8", f"hydra.sweep.dir={sweep}", timeout=300)
    assert r.returncode == 0 and len(trials_of(sweep)) == 8, r.stderr[-3000:]
    assert "best: trial" in r.stderr
    (sweep / "tune.md").unlink()
    rep = sweep_report(str(sweep))  # llaunch-report on a tuning sweep: the study's report
    assert rep.returncode == 0 and "study smoke" in rep.stdout, rep.stderr
    assert len([line for line in (sweep / "tune.md").read_text().splitlines() if line.startswith("| ")]) == 2 + 8


def test_a_study_killed_mid_trial_resumes_and_replaces_the_cut_trial(tmp_path):
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "llaunch.launcher.main", *TUNE, "hydra.sweeper.n_trials=3",
               f"hydra.sweep.dir={sweep}"]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not (sweep / "1").is_dir() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        first.kill()  # during trial 1: no chance to tell the study anything
        first.wait()
    assert (sweep / "0" / "status.json").exists(), (tmp_path / "first.log").read_text()[-3000:]
    assert [t.state.name for t in trials_of(sweep)] == ["COMPLETE", "RUNNING"]
    r = llaunch(tmp_path, *TUNE, "hydra.sweeper.n_trials=3", f"hydra.sweep.dir={sweep}", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trials = trials_of(sweep)
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert "trial 1 was cut short" in r.stdout + r.stderr
    assert all((sweep / str(n) / "status.json").exists() for n in (0, 2, 3))
