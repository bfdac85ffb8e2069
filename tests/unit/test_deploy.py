"""What deploy/ and docker/ rely on, checked against the code: the Kubernetes probes hit routes the
frontend has, the grace period covers the drain, the manifests' llaunch args compose, the Grafana
dashboard queries only series /metrics exposes (under either server.metrics_prefix), and the images
copy every folder the wheel is built from."""
from __future__ import annotations

import json
import re
import shlex
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from llaunch.runtime.config import MetricsPrefix, ServerConfig
from llaunch.runtime.detokenizer.metrics import MetricsHub
from llaunch.runtime.ipc.messages import RouterStats

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
DASHBOARD = REPO / "deploy" / "grafana" / "llaunch.json"
DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cpu"]
# launcher/supervise.py after the drain: up to 5 s past server.drain_timeout_s for the frontends to exit,
# then kill_all's 3 s SIGTERM and 10 s SIGKILL waits
STOP_AFTER_DRAIN_S = 5 + 3 + 10


@lru_cache(maxsize=1)
def frontend_get_routes() -> frozenset[str]:
    """The GET routes of the real frontend app (runtime/http/app.py)."""
    from llaunch.runtime.http.app import FrontendSettings, create_app
    from llaunch.runtime.web.lifecycle import Lifecycle

    from unit.http_support import smollm2_tokenizer
    from unit.scripted_frontend import LIMITS

    app = create_app(FrontendSettings(limits=LIMITS), engine=None, tokenizer=smollm2_tokenizer(), lifecycle=Lifecycle())
    return frozenset(rule.rule for rule in app.url_map.iter_rules() if "GET" in rule.methods)


def deployments():
    docs = [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]
    return [(name, doc) for name, doc in docs if doc["kind"] == "Deployment"], docs


def llaunch_args(container) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in container["args"])


def test_there_is_a_one_gpu_and_a_tensor_parallel_example():
    deps, _ = deployments()
    parallel = {name: llaunch_args(d["spec"]["template"]["spec"]["containers"][0]).get("parallel", "tp1")
                for name, d in deps}
    assert set(parallel.values()) == {"tp1", "tp2"}, parallel
    for name, d in deps:
        container = d["spec"]["template"]["spec"]["containers"][0]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus == int(parallel[name][2:]), f"{name}: {gpus} GPUs for parallel={parallel[name]}"


@pytest.mark.parametrize("probe,path", [("livenessProbe", "/health/live"), ("readinessProbe", "/health/ready"),
                                        ("startupProbe", "/health/ready")])
def test_the_probes_hit_the_frontends_health_routes(probe, path):
    deps, _ = deployments()
    routes = frontend_get_routes()
    for name, d in deps:
        container = d["spec"]["template"]["spec"]["containers"][0]
        get = container[probe]["httpGet"]
        assert get["path"] == path and path in routes, f"{name} {probe}: {get['path']} (routes: {sorted(routes)})"
        port = next(p for p in container["ports"] if p["name"] == get["port"])
        assert port["containerPort"] == int(llaunch_args(container)["server.port"])


def test_the_startup_probe_waits_as_long_as_llaunch_does():
    """llaunch exits when the graph is not ready after server.ready_timeout_s; the probe must not restart
    a start llaunch still waits for."""
    deps, _ = deployments()
    for name, d in deps:
        container = d["spec"]["template"]["spec"]["containers"][0]
        ready_timeout = float(llaunch_args(container).get("server.ready_timeout_s", ServerConfig().ready_timeout_s))
        probe = container["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= ready_timeout, name


def test_the_grace_period_covers_the_prestop_drain():
    deps, _ = deployments()
    for name, d in deps:
        pod = d["spec"]["template"]["spec"]
        container = pod["containers"][0]
        drain = float(llaunch_args(container)["server.drain_timeout_s"])
        assert drain == ServerConfig().drain_timeout_s, f"{name}: keep the manifest's drain with the default"
        command = " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
        assert "kill -TERM 1" in command  # llaunch (under tini) drains on SIGTERM
        sleep = float(re.search(r"sleep (\d+)", command).group(1))
        grace = pod["terminationGracePeriodSeconds"]
        assert sleep + drain + STOP_AFTER_DRAIN_S <= grace <= sleep + drain + 60, f"{name}: grace {grace}"


def test_the_services_and_scrape_annotations_point_at_the_api_port():
    deps, docs = deployments()
    services = {d["metadata"]["name"]: d for _, d in docs if d["kind"] == "Service"}
    for name, d in deps:
        template = d["spec"]["template"]
        container = template["spec"]["containers"][0]
        service = services[d["metadata"]["name"]]
        assert service["spec"]["selector"] == template["metadata"]["labels"]
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in container["ports"]}
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == llaunch_args(container)["server.port"]
        assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in frontend_get_routes()


def test_the_manifests_llaunch_args_compose(compose_config):
    deps, _ = deployments()
    for name, d in deps:
        cfg = compose_config(*d["spec"]["template"]["spec"]["containers"][0]["args"])
        assert cfg.server.host == "0.0.0.0", f"{name}: the Service reaches the pod's interface, not 127.0.0.1"


# ---- the Grafana dashboard ----------------------------------------------------------------------


def exposed_samples(prefix: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    hub = MetricsHub("m", dp=2, prefix=prefix)
    hub.record_stats(RouterStats(time=1.0, running=1, waiting=0, kv_used=1, kv_total=2, dp_rank=0))
    return {s.name for family in text_string_to_metric_families(hub.render()) for s in family.samples}


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def test_the_dashboard_queries_only_what_metrics_exposes_under_either_prefix():
    queries = dashboard_queries()
    assert all("${metric_prefix}" in q for q in queries), [q for q in queries if "${metric_prefix}" not in q]
    assert not any(re.search(r"\b(llaunch|vllm):", q) for q in queries)  # the prefix is the variable's
    for choice in MetricsPrefix:
        prefix = f"{choice.value}:"
        exposed = exposed_samples(prefix)
        used = {m for q in queries for m in re.findall(rf"{re.escape(prefix)}[a-zA-Z0-9_:]+",
                                                         q.replace("${metric_prefix}", prefix))}
        assert used and used - exposed == set(), f"not in /metrics under {prefix}: {sorted(used - exposed)}"


def test_the_dashboard_covers_serving():
    dash = json.loads(DASHBOARD.read_text())
    text = " ".join(dashboard_queries())
    for series in ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket", "num_requests_waiting",
                   "kv_cache_usage_perc", "prefix_cache_hits_total", "spec_decode_num_accepted_tokens_total"):
        assert "${metric_prefix}" + series in text, series
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    prefix = next(v for v in dash["templating"]["list"] if v["name"] == "metric_prefix")
    assert {o["value"] for o in prefix["options"]} == {f"{c.value}:" for c in MetricsPrefix}
    assert prefix["current"]["value"] == f"{ServerConfig().metrics_prefix.value}:"


# ---- the images ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_images_build_the_wheel_from_every_package_folder_and_run_llaunch(dockerfile):
    text = dockerfile.read_text()
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    roots = {d.split("/")[0] for d in package_dirs}
    copied = {line.split()[1] for line in text.splitlines() if line.startswith("COPY ") and "--from" not in line}
    assert roots | {"pyproject.toml"} == copied
    allowed = {line[1:] for line in Path(f"{dockerfile}.dockerignore").read_text().splitlines() if line.startswith("!")}
    assert copied <= allowed
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    assert entrypoint[-1] == "llaunch" and entrypoint[0] == "tini"  # PID 1 forwards SIGTERM: the drain
    assert re.search(r"^USER (\S+)$", text, re.M).group(1) not in ("root", "0")
    assert f"EXPOSE {ServerConfig().port}" in text
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert cmd == ["server.host=0.0.0.0"]  # published ports reach the container's interface
    assert "LLAUNCH_MODELS_DIR=/models" in text and shlex.split("chown llaunch:llaunch /models")[0] in text
