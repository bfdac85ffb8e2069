"""The `llaunch` command as a user runs it: --help, --cfg job, dry runs, sweeps and the exit-2 cases.
Every run is a subprocess in a temporary directory, so nothing lands in the repo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llaunch.runtime.bootstrap import load_run_config

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]


def llaunch(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llaunch.launcher.main", *args]
    if not any(a.startswith(("-", "hydra.")) for a in args):
        cmd.append(f"hydra.run.dir={tmp_path / 'run'}")
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, COLUMNS="200", **(env or {})))


def test_help_lists_profiles_and_every_key_with_type_default_and_description(tmp_path):
    r = llaunch(tmp_path, "--help")
    assert r.returncode == 0, r.stderr
    profiles = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    assert {"qwen2", "llama", "smollm2-135m", "qwen2-7b"} <= set(profiles)
    assert f"model: {', '.join(profiles)}\n" in r.stdout  # every model profile, by name
    assert "_schema" not in r.stdout  # schemas are not user-facing options
    assert "  router.max_running_requests  int = 1000\n      requests in the running batch" in r.stdout
    assert "  server.tool_call_format  hermes|llama3_json? = null\n" in r.stdout
    lines = r.stdout.split("Keys (")[1].splitlines()
    keys = [i for i, line in enumerate(lines) if line.startswith("  ") and line[2] != " " and " = " in line]
    assert len(keys) > 80
    for i in keys:  # each key line is followed by its description
        assert lines[i + 1].startswith("      ") and lines[i + 1].strip(), f"{lines[i]} has no description"
    version = llaunch(tmp_path, "--version")
    assert version.returncode == 0 and version.stdout.strip() == "llaunch 0.1.0"


@pytest.mark.parametrize("override,message", [
    ("router.max_runing_requests=64", "did you mean router.max_running_requests"),
    ("+router.max_runing_requests=64", "did you mean router.max_running_requests"),
    ("+devcie=cpu", "did you mean device"),
    ("server.prot=1", "did you mean server.port"),
])
def test_a_misspelled_key_exits_2_naming_the_closest_one(tmp_path, override, message):
    r = llaunch(tmp_path, override, "dry_run=true")
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cfg_job_prints_the_composed_config(tmp_path):
    r = llaunch(tmp_path, "--cfg", "job", "model=qwen2-7b", "parallel=tp2", "bench=c64")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert (cfg["model"]["hidden_size"], cfg["parallel"]["tp"], cfg["bench"]["concurrency"]) == (3584, 2, 64)
    assert not (tmp_path / "outputs").exists()


def test_default_dry_run_writes_the_run_config_and_prints_the_graph(tmp_path):
    r = llaunch(tmp_path, "dry_run=true", env={"LLAUNCH_MODELS_DIR": str(tmp_path / "no-models")})
    assert r.returncode == 0, r.stderr
    run = load_run_config(str(tmp_path / "run" / "config.yaml"))  # as every child reads it
    assert run.run_dir == str(tmp_path / "run") and run.model.name == "smollm2-135m"
    for spec in run.graph.processes:
        assert spec.name in r.stdout
        for addr in [*spec.binds.values(), *spec.connects.values()]:
            assert addr in r.stdout
    assert "model.path" in r.stderr and "does not exist" in r.stderr  # warned, still planned
    assert not Path(run.graph.ipc_dir).exists()  # a dry run leaves no sockets behind


def test_family_profile_without_a_path(tmp_path):
    args = ("model=qwen2", "parallel=tp8", "mode=pd_decode")
    dry = llaunch(tmp_path, *args, "dry_run=true")
    assert dry.returncode == 0, dry.stderr
    assert "worker.0.7" in dry.stdout and "pd_master" in dry.stdout and "kv_transfer" in dry.stdout
    assert "waits for model.path" in dry.stderr and "tp_splits_heads" in dry.stderr
    (tmp_path / "live").mkdir()
    live = llaunch(tmp_path / "live", *args)
    assert live.returncode == 2
    assert "model.path is required" in live.stderr and "qwen2-7b" in live.stderr
    assert not (tmp_path / "live" / "run" / "config.yaml").exists()  # nothing planned, nothing started


def test_heads_that_do_not_split_exit_2(tmp_path):
    r = llaunch(tmp_path, "model=qwen2-7b", "model.load_format=dummy", "parallel=tp8", "dry_run=true")
    assert r.returncode == 2
    assert "tp_splits_heads" in r.stderr and "num_attention_heads=28" in r.stderr and "parallel.tp=8" in r.stderr


def test_all_violations_are_listed_at_once(tmp_path):
    r = llaunch(tmp_path, "cache.mem_fraction=1.5", "server.http_workers=0", "device=cuda", "dry_run=true")
    assert r.returncode == 2
    assert "cache.mem_fraction=1.5" in r.stderr and "(0, 1)" in r.stderr
    assert "server.http_workers=0" in r.stderr and "2 rules violated" in r.stderr


def test_a_key_set_where_nothing_reads_it_exits_2_and_a_profiles_keys_do_not(tmp_path):
    r = llaunch(tmp_path, "spec.num_tokens=3", "router.dp_prefill_balance=true", "dry_run=true")
    assert r.returncode == 2, r.stderr  # both keys listed at once
    assert "spec.num_tokens=3 has no effect with spec.method=none" in r.stderr
    assert "router.dp_prefill_balance=true has no effect with parallel.dp=1" in r.stderr
    # a pd_master runs no model: the profile's model keys pass, a model key the user sets does not
    assert llaunch(tmp_path, "mode=pd_master", "model=qwen2-7b", "dry_run=true").returncode == 0
    r = llaunch(tmp_path, "mode=pd_master", "model=qwen2-7b", "model.max_model_len=4096", "dry_run=true")
    assert r.returncode == 2 and "model.max_model_len=4096 has no effect with mode.kind=pd_master" in r.stderr
    # a sweep's jobs are checked with their own overrides (a bench job's bench keys in the sweep process)
    r = llaunch(tmp_path, "-m", "bench=c1", "bench.trace=/no/such.jsonl", "bench.request_rate=2,4",
                f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert r.returncode == 2, r.stderr
    reasons = [json.loads((tmp_path / "sweep" / str(i) / "status.json").read_text())["reason"] for i in (0, 1)]
    assert all("bench.request_rate" in why and "has no effect with bench.trace" in why for why in reasons), reasons


def test_composition_errors_exit_2_without_a_traceback(tmp_path):
    for override, named in [("cache.mem_fractio=1", "mem_fractio"), ("model=nope", "model/nope"),
                            ("server.port=abc", "server.port")]:
        r = llaunch(tmp_path, override)
        assert r.returncode == 2, (override, r.stderr)
        assert named in r.stderr and "Traceback" not in r.stderr
    # a value holding '=' parses only quoted: the error names the override and shows it quoted
    r = llaunch(tmp_path, "kernels.gemv_shapes=152064x3584:fp8=64/256/4/3")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "kernels.gemv_shapes=152064x3584:fp8=64/256/4/3: mismatched input '='" in r.stderr
    assert "\"kernels.gemv_shapes='152064x3584:fp8=64/256/4/3'\"" in r.stderr


def test_big_model_on_eight_gpus_plans_on_a_machine_without_them(tmp_path):
    r = llaunch(tmp_path, "model=qwen2-72b", "parallel=tp8", "mode=pd_decode", "device=cuda", "dry_run=true")
    assert r.returncode == 0, r.stderr
    run = load_run_config(str(tmp_path / "run" / "config.yaml"))
    assert [p.gpus for p in run.graph.processes if p.role == "worker"] == [[g] for g in range(8)]
    assert "GPU 7" in r.stdout and run.model.dtype.value == "bfloat16"


def test_sweep_dry_runs_every_job(tmp_path):
    r = llaunch(tmp_path, "-m", "mode=normal,pd_master", "model=tiny-qwen2", "dry_run=true",
                f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert r.returncode == 0, r.stderr
    kinds = [load_run_config(str(tmp_path / "sweep" / str(i) / "config.yaml")).mode.kind.value for i in (0, 1)]
    assert kinds == ["normal", "pd_master"]


def test_dry_run_reports_memory_and_a_start_that_cannot_fit_exits_2(tmp_path):
    dry = llaunch(tmp_path, "model=qwen2-7b", "model.load_format=dummy", "device=cuda", "parallel=tp2",
                  "dry_run=true")
    assert dry.returncode == 0, dry.stderr
    # 7,615,616,512 bfloat16 parameters over two ranks; 28 layers x 2 KV heads x 128 x (K, V) x 2 bytes
    assert "weights 7.1 GiB (bfloat16)" in dry.stderr and "KV 28 KiB per token" in dry.stderr
    (tmp_path / "live").mkdir()  # Qwen2-72B in float32 on CPU: 271 GiB of weights, more than any CI host
    live = llaunch(tmp_path / "live", "model=qwen2-72b", "model.load_format=dummy", "device=cpu")
    assert live.returncode == 2 and "weights_fit_memory" in live.stderr and "host's" in live.stderr, live.stderr


def test_a_plain_dry_run_writes_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "llaunch.launcher.main", "dry_run=true"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=100, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    assert "worker.0.0" in r.stdout and "writes nothing" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/DATE/TIME
    scratch = r.stdout.split("run dir", 1)[1].split()[0]
    assert not Path(scratch).exists()


def test_a_hub_id_is_served_from_the_local_hugging_face_cache(tmp_path):
    from transformers import Qwen2Config

    cache = tmp_path / "hub"  # huggingface_hub's cache layout: refs/main names the snapshot
    repo = cache / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / ("0" * 40)
    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    r = llaunch(tmp_path, "model=qwen2", "model.path=acme/tiny-chat", "model.load_format=dummy",
                "model.tokenizer=null", "dry_run=true", env=env)
    assert r.returncode == 0, r.stderr
    run = load_run_config(str(tmp_path / "run" / "config.yaml"))
    assert run.model.path == str(snapshot) and run.model.name == "acme/tiny-chat"  # served as vLLM does
    assert run.model.hidden_size == 64
    missing = llaunch(tmp_path, "model=qwen2", "model.path=acme/not-cached", "dry_run=true", env=env)
    assert missing.returncode == 2 and "neither a local path nor in the Hugging Face cache" in missing.stderr
