"""A tuning trial's score (launcher/tune_objective.py) and the study's report (launcher/tune_report.py):
the best trial as a serving profile, the goodput-latency frontier."""
from __future__ import annotations

import pytest
import yaml

from llaunch.launcher import tune_objective, tune_report
from llaunch.runtime.config import BenchConfig

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not


def run(goodput, good, completed, failed=0, throughput=9.0):
    return {"goodput": goodput, "good_requests": good, "completed": completed, "failed": failed,
            "request_throughput": throughput}


def test_the_score_is_the_lowest_runs_goodput():
    bench = BenchConfig(slo_ttft_ms=100.0, repeats=2)
    assert tune_objective.objective(bench, {"runs": [run(3.0, 9, 10), run(2.0, 8, 10)]}) == (2.0, "")


def test_a_run_under_the_slo_percentile_scores_0_with_its_reason():
    bench = BenchConfig(slo_tpot_ms=50.0, slo_percentile=90.0)
    score, note = tune_objective.objective(bench, {"runs": [run(3.0, 9, 10), run(2.5, 8, 10)]})
    assert score == 0.0 and "80.0% of requests met the SLOs" in note and "bench.slo_percentile=90" in note
    assert tune_objective.objective(bench, {"runs": [run(3.0, 9, 10)]}) == (3.0, "")


def test_without_slos_every_completed_request_counts():
    assert tune_objective.objective(BenchConfig(), {"runs": [run(None, 0, 10, throughput=4.5)]}) == (4.5, "")


def test_the_profile_holds_the_serving_overrides_and_not_the_benchmarks(tmp_path):
    trial = tune_report.Trial(
        number=3, state="COMPLETE", score=1.5,
        params={"router.max_running_requests": 48, "router.chunked_prefill_size": 1024},
        fixed={"bench": "c64", "bench.slo_ttft_ms": "500", "model": "qwen2-7b", "device": "cuda",
               "+server.api_key": "", "model.dtype": "bfloat16", "cache.prompt_cache": "false"},
        status={}, bench={"args": {"num_prompts": 512}})
    text = tune_report.profile_yaml(trial, "mine", 20, tmp_path)
    assert text.startswith("# @package _global_\n")
    assert f"llaunch --config-dir {tmp_path} +tuned=mine" in text
    profile = yaml.safe_load(text)
    assert profile == {"defaults": [{"override /model": "qwen2-7b"}], "device": "cuda",
                       "model": {"dtype": "bfloat16"}, "cache": {"prompt_cache": False},
                       "server": {"api_key": ""},
                       "router": {"max_running_requests": 48, "chunked_prefill_size": 1024}}


def test_the_frontier_keeps_the_points_nothing_beats():
    points = [(100.0, 1.0, 0), (200.0, 3.0, 1), (150.0, 0.5, 2), (300.0, 2.0, 3), (250.0, 3.5, 4)]
    assert tune_report.frontier(points) == [(100.0, 1.0, 0), (200.0, 3.0, 1), (250.0, 3.5, 4)]


def test_trace_and_percentile_settings_are_checked(compose_config, tmp_path):
    from llaunch.launcher import derive, rules

    def violated(*overrides):
        cfg = derive.resolve(compose_config("model=tiny-qwen2", "device=cpu", "bench=tune_smoke", *overrides))
        return [v.message for v in rules.check_all(cfg) if v.rule == "bench_settings_valid"]

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "input_len": 3, "output_len": 2}\n')
    assert violated(f"bench.trace={trace}", "bench.slo_percentile=90") == []
    assert violated(f"bench.trace={tmp_path}/none.jsonl") == [
        f"bench.trace={tmp_path}/none.jsonl: no such file (a JSONL trace, scripts/bench_trace.py)"]
    assert violated("bench.slo_percentile=0") == ["bench.slo_percentile=0.0 must be in (0, 100]"]
    assert "single-turn" in violated("bench.lengths=sharegpt", "bench.multi_turn=2")[0]


def test_a_resumed_study_fails_the_trials_an_interruption_cut_short(tmp_path):
    import optuna

    from llaunch.launcher import tune_sweeper

    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}", direction="maximize")
    study.tell(study.ask(), 1.0)
    study.ask()  # its sweep was killed while the trial ran
    assert tune_sweeper.fail_interrupted(study) == [1]
    reloaded = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert [t.state.name for t in reloaded.trials] == ["COMPLETE", "FAIL"] and reloaded.best_value == 1.0
    assert reloaded.trials[1].user_attrs == {tune_sweeper.INTERRUPTED: True}  # replaced, not counted


def test_the_tune_sweeper_and_its_ready_search_space_compose():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "llaunch.launcher.main", "hydra/sweeper=tune",
                          "+hydra/sweeper/params=router", "bench=tune_smoke", "--cfg", "hydra"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sweeper = yaml.safe_load(out.stdout)["hydra"]["sweeper"]
    assert sweeper["_target_"] == "hydra_plugins.llaunch_tune.TuneSweeper" and sweeper["direction"] == "maximize"
    assert sweeper["sampler"]["_target_"] == "optuna.samplers.TPESampler" and sweeper["n_jobs"] == 1
    assert sweeper["params"]["router.max_running_requests"] == "int(interval(16, 1024))"
    assert set(sweeper["params"]) == {"router.max_running_requests", "router.chunked_prefill_size",
                                      "router.batch_max_tokens"}
