"""/metrics' names and formats: server.metrics_prefix=vllm exposes vLLM's series under vLLM's names,
every series carries the chosen prefix, and a scraper asking for OpenMetrics (Prometheus does) gets it,
from the frontend and from server.metrics_port's listener alike."""
from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from llaunch.runtime.config import MetricsPrefix
from llaunch.runtime.detokenizer.metrics import MetricsHub
from llaunch.runtime.metrics_exposition import PROMETHEUS_CONTENT_TYPE, exposition
from llaunch.runtime.ipc.messages import RouterStats

from unit.http_support import METRICS_TEXT

# The samples vLLM v1 exposes (vllm/v1/metrics/loggers.py, 0.11) that llaunch has too, with vLLM's meaning.
# Not here: gpu_cache_usage_perc and time_per_output_token_seconds (vLLM's names before 0.11 of
# kv_cache_usage_perc and inter_token_latency_seconds; vLLM's example Grafana dashboard still reads them) and
# request_max_num_generation_tokens (the longest of a request's n samples).
VLLM_HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                   "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens")
VLLM_COUNTERS = ("prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries", "prefix_cache_hits",
                 "num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens", "mm_cache_queries", "mm_cache_hits")
VLLM_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
VLLM_SAMPLES = ({f"vllm:{h}{s}" for h in VLLM_HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
                | {f"vllm:{c}_total" for c in VLLM_COUNTERS} | {f"vllm:{g}" for g in VLLM_GAUGES})

PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                       "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
PROMETHEUS_3_ACCEPT = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,application/openmetrics"
                       "-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;"
                       "version=0.0.4;q=0.2,*/*;q=0.1")


def busy_hub(prefix: str) -> MetricsHub:
    hub = MetricsHub("m", dp=2, prefix=prefix)
    hub.first_token(100.0, 100.5, prompt_tokens=12, scheduled_time=100.1)
    hub.token_gap(0.02)
    hub.generated(3)
    hub.finished(100.0, 101.0, "stop", prompt_tokens=12, output_tokens=3, first_token_time=100.5,
                 scheduled_time=100.1)
    hub.record_stats(RouterStats(time=1.0, running=2, waiting=1, kv_used=50, kv_total=100, dp_rank=1,
                                 prefix_cache_queries=40, prefix_cache_hits=10))
    return hub


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for family in parse_prometheus(text) for s in family.samples}


def test_the_vllm_prefix_exposes_vllms_names():
    names = set(samples(busy_hub("vllm:").render()))
    assert VLLM_SAMPLES - names == set()


def test_every_series_carries_the_chosen_prefix_and_only_it_changes():
    for choice in MetricsPrefix:
        names = set(samples(busy_hub(f"{choice.value}:").render()))
        assert all(n.startswith(f"{choice.value}:") for n in names), sorted(n for n in names if ":" not in n)
    llaunch, vllm = (samples(busy_hub(p).render()) for p in ("llaunch:", "vllm:"))
    assert {n.replace("llaunch:", "vllm:", 1): v for n, v in llaunch.items()} == vllm


def test_the_key_composes_and_reaches_the_detokenizers_hub(compose_config):
    from llaunch.runtime.detokenizer.detokenizer import Detokenizer

    assert compose_config().server.metrics_prefix is MetricsPrefix.llaunch
    assert compose_config("server.metrics_prefix=vllm").server.metrics_prefix is MetricsPrefix.vllm
    with pytest.raises(Exception, match="metrics_prefix"):
        compose_config("server.metrics_prefix=sglang")
    detok = Detokenizer(tokenizer=None, model_name="m", metrics_prefix="vllm:")
    assert "vllm:num_requests_running" in samples(detok.metrics.render())


@pytest.mark.parametrize("accept", [PROMETHEUS_2_ACCEPT, PROMETHEUS_3_ACCEPT, "application/openmetrics-text"])
def test_openmetrics_when_the_scraper_asks_for_it(accept):
    hub, process = busy_hub("llaunch:"), CollectorRegistry()
    ProcessCollector(registry=process)
    body, content_type = exposition(hub.render(), process, accept)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    assert "\nllaunch_" not in text  # prometheus_client's `underscores` escaping would rename samples only
    families = {f.name: f for f in parse_openmetrics(text)}  # the strict parser: a malformed body raises
    assert families["llaunch:prompt_tokens"].type == "counter" and "process_cpu_seconds" in families
    want = samples(hub.render())
    got = {s.name: s.value for f in families.values() for s in f.samples if s.name.startswith("llaunch:")}
    assert got == want  # the same series and values as the Prometheus text


@pytest.mark.parametrize("accept", ["", "text/plain", "*/*", "application/json"])
def test_prometheus_text_otherwise_as_rendered(accept):
    hub, process = busy_hub("llaunch:"), CollectorRegistry()
    body, content_type = exposition(hub.render(), process, accept)
    assert content_type == PROMETHEUS_CONTENT_TYPE and body.decode() == hub.render()


def test_the_frontend_negotiates_the_format(scripted_server):
    status, ctype, data = scripted_server.raw("GET", "/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
    assert status == 200 and ctype.startswith("application/openmetrics-text")
    families = {f.name for f in parse_openmetrics(data.decode())}
    assert {"llaunch_requests_running", "process_resident_memory_bytes"} <= families
    status, ctype, data = scripted_server.raw("GET", "/metrics")
    assert ctype == PROMETHEUS_CONTENT_TYPE and data.decode().startswith(METRICS_TEXT)


def test_the_metrics_port_listener_negotiates_too():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hub = busy_hub("vllm:")
    hub.serve(f"http://127.0.0.1:{port}/metrics")
    for accept, content_type in ((PROMETHEUS_2_ACCEPT, "application/openmetrics-text"), ("", "text/plain")):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith(content_type)
            parse = parse_openmetrics if accept else parse_prometheus
            assert "vllm:kv_cache_usage_perc" in {s.name for f in parse(resp.read().decode()) for s in f.samples}


def test_speculation_counters_add_what_each_replica_reports():
    """Each router reports totals since its start; per-position acceptance and backoffs count what is new,
    summed over dp replicas, position by position (vLLM's spec_decode_num_accepted_tokens_per_pos)."""
    hub = MetricsHub("m", dp=2, prefix="llaunch:")

    def report(rank: int, per_pos: list[int], backoffs: int, chained: int = 0, voided: int = 0) -> None:
        hub.record_stats(RouterStats(time=1.0, running=1, waiting=0, kv_used=1, kv_total=10, dp_rank=rank,
                                     spec_accepted_per_pos=per_pos, spec_backoffs=backoffs, spec_chained=chained,
                                     spec_voided=voided))

    report(0, [3, 1, 0, 0], 1, 4, 1)
    report(0, [5, 2, 1, 0], 1, 9, 2)
    report(1, [2, 2, 2, 1], 2, 5, 5)
    got = {(f.name, s.labels.get("position")): s.value for f in parse_prometheus(hub.render()) for s in f.samples
           if s.name.startswith("llaunch:spec_decode_num_")}
    assert [got[("llaunch:spec_decode_num_accepted_tokens_per_pos", str(i))] for i in range(4)] == [7, 4, 3, 1]
    assert got[("llaunch:spec_decode_num_backoffs", None)] == 3
    assert got[("llaunch:spec_decode_num_chained", None)] == 14 and got[("llaunch:spec_decode_num_voided", None)] == 7
