"""scripts/bench_trace.py and the client's traffic-shaped workloads: a recorded trace is replayed (its
arrival times, prompt and output lengths), ShareGPT-like lengths have the documented shape."""
from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest

from unit.test_bench_serving import StreamingServer


@pytest.fixture(scope="module")
def trace_mod(bench):
    return sys.modules["bench_trace"]


def write_lines(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_trace_is_read_in_arrival_order_with_mooncake_names_too(trace_mod, tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [{"arrival_s": 2.5, "input_len": 7, "output_len": 3},
                                              {"timestamp": 1000, "input_length": 5, "output_length": 2}])
    records = trace_mod.read_trace(path)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in records] == [(1.0, 5, 2), (2.5, 7, 3)]
    assert trace_mod.trace_workload(records, 10) == ([5, 7], [2, 3], [0.0, 1.5])
    assert trace_mod.trace_workload(records, 1) == ([5], [2], [0.0])


@pytest.mark.parametrize("line, words", [({"arrival_s": 0, "input_len": 3}, "output_len"),
                                         ({"arrival_s": 0, "input_len": 0, "output_len": 1}, ">= 1"),
                                         ("not json", "not JSON")])
def test_a_malformed_trace_line_is_named(trace_mod, tmp_path, line, words):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "input_len": 1, "output_len": 1}\n'
                    + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    with pytest.raises(ValueError, match=f"t.jsonl:2.*{words}"):
        trace_mod.read_trace(path)


def test_sharegpt_lengths_are_long_tailed_around_the_means(trace_mod):
    inputs, outputs = trace_mod.sharegpt_lengths(20000, 256, 128, seed=0)
    inputs, outputs = np.array(inputs), np.array(outputs)
    assert inputs.mean() == pytest.approx(256, rel=0.05) and outputs.mean() == pytest.approx(128, rel=0.05)
    # log-normal: the median well under the mean (ShareGPT's long conversations), nothing below 1
    assert np.median(inputs) < 0.6 * inputs.mean() and np.median(outputs) < 0.75 * outputs.mean()
    assert inputs.min() >= 1 and outputs.min() >= 1 and inputs.max() <= 16 * 256
    assert trace_mod.sharegpt_lengths(50, 256, 128, seed=1) != trace_mod.sharegpt_lengths(50, 256, 128, seed=2)
    cut_in, cut_out = trace_mod.sharegpt_lengths(2000, 256, 128, seed=0, max_model_len=300)
    assert max(i + o for i, o in zip(cut_in, cut_out)) <= 300


def test_the_generator_writes_a_trace_the_reader_replays(trace_mod, tmp_path):
    out = tmp_path / "gen.jsonl"
    trace_mod.main(["--num", "2000", "--rate", "50", "--input-len", "64", "--output-len", "32", "--out", str(out)])
    records = trace_mod.read_trace(out)
    gaps = np.diff([r.arrival_s for r in records])
    assert len(records) == 2000 and records[0].arrival_s == 0.0
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.08)  # Poisson arrivals at the rate
    assert np.mean([r.input_len for r in records]) == pytest.approx(64, rel=0.1)


class TimedServer(StreamingServer):
    """Also records when each request arrived."""

    def __init__(self, *a):
        super().__init__(*a)
        self.arrivals: list[float] = []

    async def _respond(self, payload, writer):
        self.arrivals.append(time.perf_counter())
        await super()._respond(payload, writer)


def test_the_client_replays_a_trace_lengths_and_arrival_times(bench, tmp_path):
    lines = [{"arrival_s": 10.0 + t, "input_len": n, "output_len": m}
             for t, n, m in ((0.0, 5, 3), (0.3, 9, 1), (0.3, 2, 4), (0.8, 7, 2), (5.0, 4, 4))]
    path = write_lines(tmp_path / "t.jsonl", lines)
    with TimedServer(0.005, 0.002) as server:
        result = bench.main(["--base-url", server.url, "--model", "m", "--num-prompts", "4", "--concurrency", "4",
                             "--warmup", "0", "--vocab-size", "500", "--trace", str(path)])
    assert result["completed"] == 4  # --num-prompts takes the trace's first 4 requests
    sent = sorted(zip(server.arrivals, server.payloads), key=lambda x: x[0])
    assert sorted((len(p["prompt"]), p["max_tokens"]) for _, p in sent) == [(2, 4), (5, 3), (7, 2), (9, 1)]
    t0 = sent[0][0]
    for arrival, payload in sent:  # no request goes out before its time in the trace
        offset = next(line["arrival_s"] - 10.0 for line in lines if line["input_len"] == len(payload["prompt"]))
        assert arrival - t0 >= offset - 0.005
    assert [len(p["prompt"]) for _, p in sent][-1] == 7  # the last one arrives last
    assert result["total_output_tokens"] == 3 + 1 + 4 + 2


def test_the_client_draws_sharegpt_lengths(bench):
    with StreamingServer(0.001, 0.001) as server:
        result = bench.main(["--base-url", server.url, "--model", "m", "--num-prompts", "12", "--input-len", "20",
                             "--output-len", "4", "--concurrency", "4", "--warmup", "0", "--vocab-size", "500",
                             "--lengths", "sharegpt", "--max-model-len", "64"])
    lengths = [(len(p["prompt"]), p["max_tokens"]) for p in server.payloads]
    assert result["completed"] == 12 and len(set(lengths)) > 3  # lengths vary
    assert all(n + m <= 64 for n, m in lengths)
    assert result["total_output_tokens"] == sum(m for _, m in lengths)


def test_trace_workloads_are_single_turn(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", "--lengths", "sharegpt", "--multi-turn", "2"])
    assert "single-turn" in capsys.readouterr().err
