"""scripts/bench_serving.py: metric definitions on synthetic timings (hand-computed oracles), SSE
timing, prompts (plain, shared-prefix, multi-turn) and arrivals, and the client against a small real
HTTP/1.1 streaming server."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not



# ---- pure functions ------------------------------------------------------------------------------


def test_metrics_on_synthetic_timings(bench):
    R = bench.RequestOutput
    outputs = [
        R(prompt_len=10, success=True, ttft=0.1, latency=1.1, itl=[0.25, 0.25, 0.25, 0.25], output_tokens=5),
        R(prompt_len=10, success=True, ttft=0.2, latency=2.2, itl=[0.5, 0.5, 0.5, 0.5], output_tokens=5),
        R(prompt_len=10, success=True, ttft=0.6, latency=0.6, itl=[], output_tokens=1),  # no TPOT
        R(prompt_len=10, success=False, error="HTTP 500"),  # excluded everywhere
    ]
    m = bench.compute_metrics(outputs, duration=4.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 11)
    assert m["request_throughput"] == pytest.approx(3 / 4.0)
    assert m["output_throughput"] == pytest.approx(11 / 4.0)
    assert m["total_token_throughput"] == pytest.approx(41 / 4.0)
    # TTFT over [0.1, 0.2, 0.6]: p99 by linear interpolation at rank 0.99 * 2 = 1.98
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(200.0 + 0.98 * 400.0)
    # TPOT = (latency - ttft) / (out - 1): 1.0/4 and 2.0/4
    assert m["mean_tpot_ms"] == pytest.approx(375.0)
    assert m["median_tpot_ms"] == pytest.approx(375.0)
    assert m["p99_tpot_ms"] == pytest.approx(250.0 + 0.99 * 250.0)
    # ITL pools every gap: four of 0.25 and four of 0.5
    assert m["mean_itl_ms"] == pytest.approx(375.0)
    assert m["median_itl_ms"] == pytest.approx(375.0)
    assert m["p99_itl_ms"] == pytest.approx(500.0)
    assert m["mean_e2el_ms"] == pytest.approx(1300.0)
    assert m["median_e2el_ms"] == pytest.approx(1100.0)


def test_metrics_with_nothing_completed(bench):
    m = bench.compute_metrics([bench.RequestOutput(prompt_len=3, error="boom")], duration=2.0)
    assert (m["completed"], m["failed"], m["request_throughput"]) == (0, 1, 0.0)
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0


def test_stream_timer_on_sse_lines(bench):
    timer = bench.StreamTimer(prompt_len=4, start=100.0)
    chunk = lambda text: "data: " + json.dumps({"choices": [{"index": 0, "text": text}]})  # noqa: E731
    lines = [(": keep-alive", 100.05), (chunk("Hel"), 100.3), ("", 100.3), (chunk("lo"), 100.4),
             (chunk(""), 100.45), (chunk(" you"), 100.7),
             ("data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}}), 100.8),
             ("data: [DONE]", 100.9)]
    for line, t in lines:
        timer.on_line(line, t)
    out = timer.finish()
    assert out.success and out.error == ""
    assert out.ttft == pytest.approx(0.3)
    assert out.itl == pytest.approx([0.1, 0.05, 0.25])
    assert out.latency == pytest.approx(0.7)  # the usage-only chunk and [DONE] do not count
    assert out.output_tokens == 6  # from usage, not the 4 chunks
    assert out.generated_text == "Hello you"


def test_stream_timer_without_usage_counts_chunks_and_reports_errors(bench):
    timer = bench.StreamTimer(prompt_len=1, start=0.0)
    for t in (1.0, 2.0, 3.0):
        timer.on_line('data: {"choices": [{"text": "x"}]}', t)
    assert timer.finish().output_tokens == 3
    failed = bench.StreamTimer(prompt_len=1, start=0.0)
    failed.on_line('data: {"error": {"message": "overloaded"}}', 1.0)
    out = failed.finish()
    assert not out.success and "overloaded" in out.error
    assert not bench.StreamTimer(prompt_len=1, start=0.0).finish().success  # no chunk at all


def test_random_prompts_exact_length_and_range(bench):
    prompts = bench.random_prompts(50, 37, vocab_size=300, seed=7)
    assert len(prompts) == 50 and all(len(p) == 37 for p in prompts)
    flat = np.array(prompts)
    assert flat.min() >= 100 and flat.max() < 300 and len(np.unique(flat)) > 150
    assert prompts == bench.random_prompts(50, 37, vocab_size=300, seed=7)
    assert prompts != bench.random_prompts(50, 37, vocab_size=300, seed=8)


def test_one_turn_without_groups_is_the_plain_workload(bench):
    assert bench.conversation_turns(6, 9, 500, seed=3) == [[p] for p in bench.random_prompts(6, 9, 500, seed=3)]


def test_shared_prefix_prompts_put_a_group_system_prompt_before_each_own_part(bench, workload):
    convs = bench.conversation_turns(7, 5, 1000, seed=1, groups=3, prefix_len=12)
    own = bench.random_prompts(7, 5, 1000, seed=1)
    systems = bench.random_prompts(3, 12, 1000, seed=1 + workload.SYSTEM_PROMPT_SEED)
    assert len({tuple(s) for s in systems}) == 3
    for i, conv in enumerate(convs):
        assert len(conv) == 1
        assert conv[0] == systems[i % 3] + own[i]  # round robin over the groups
    assert all(100 <= t < 1000 for conv in convs for t in conv[0])


def test_multi_turn_conversations_get_fresh_turns_of_input_len(bench):
    convs = bench.conversation_turns(4, 6, 1000, seed=2, groups=2, prefix_len=3, turns=3)
    assert [len(c) for c in convs] == [3] * 4
    assert all(len(c[0]) == 9 and len(c[1]) == len(c[2]) == 6 for c in convs)
    later = [tuple(t) for c in convs for t in c[1:]]
    assert len(set(later)) == 8  # every later turn is new
    assert convs == bench.conversation_turns(4, 6, 1000, seed=2, groups=2, prefix_len=3, turns=3)


def test_prefix_cache_counts_from_prometheus_text(bench):
    text = ("# TYPE llaunch:prefix_cache_queries counter\n"
            'llaunch:prefix_cache_queries_total{model_name="m"} 120.0\n'
            'llaunch:prefix_cache_hits_total{model_name="m"} 30.0\n'
            'vllm:prefix_cache_queries_total{engine="1"} 5\n'
            "llaunch:prefix_cache_usage_perc 0.5\n"
            'llaunch:prompt_tokens_total{model_name="m"} 999.0\n')
    assert bench.prefix_cache_counts(text) == (125.0, 30.0)
    assert bench.prefix_cache_counts('llaunch:prompt_tokens_total{model_name="m"} 9.0\n') is None
    tiered = text + ('llaunch:prefix_cache_host_hits_total{model_name="m"} 10.0\n'
                     'llaunch:kv_promoted_tokens_total{model_name="m"} 10.0\n'
                     'llaunch:kv_demoted_tokens_total{model_name="m"} 40.0\n'
                     'llaunch:dp_fetched_tokens_total{model_name="m"} 16.0\n')
    assert bench.prefix_cache_counts(tiered) == (125.0, 30.0, 10.0, 10.0, 40.0, 16.0)


def test_a_conversation_resends_its_history_and_stops_at_a_failed_turn(bench):
    sent = []

    async def send(prompt):
        sent.append(prompt)
        if len(sent) == 3:
            return bench.RequestOutput(prompt_len=len(prompt), error="HTTP 500")
        return bench.RequestOutput(prompt_len=len(prompt), success=True, output_tokens=2,
                                   output_ids=[900 + len(sent), 950 + len(sent)])

    outs = asyncio.run(bench.run_conversation(send, [[1, 2], [3], [4, 5], [6]]))
    assert sent == [[1, 2], [1, 2, 901, 951, 3], [1, 2, 901, 951, 3, 902, 952, 4, 5]]
    assert [o.success for o in outs] == [True, True, False, False]
    assert outs[3].error == "an earlier turn of the conversation failed"


def test_arrival_offsets(bench):
    assert bench.arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    offsets = np.array(bench.arrival_offsets(20000, 50.0, seed=0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50.0, rel=0.05)  # exponential: std == mean


# ---- the client against a real HTTP/1.1 server streaming SSE --------------------------------------


class StreamingServer:
    """/v1/completions over HTTP/1.1 keep-alive: `max_tokens` chunks, `first_s` before the first and
    `gap_s` between the others, then a usage chunk and [DONE]. Records payloads and peak load."""

    def __init__(self, first_s: float, gap_s: float):
        self.first_s, self.gap_s = first_s, gap_s
        self.payloads: list[dict] = []
        self.queries = self.hits = 0  # a prompt cache's counters: longest prefix of an earlier prompt
        self.in_flight = self.peak = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        self.ready.wait(5)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /metrics "):
                    body = (f'llaunch:prefix_cache_queries_total{{model_name="m"}} {self.queries}\n'
                            f'llaunch:prefix_cache_hits_total{{model_name="m"}} {self.hits}\n').encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
                    continue
                length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n")
                              if h.lower().startswith(b"content-length"))
                await self._respond(json.loads(await reader.readexactly(length)), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def _count_prefix(self, prompt):
        best = 0
        for earlier in self.payloads:
            n = 0
            while n < min(len(prompt) - 1, len(earlier["prompt"])) and prompt[n] == earlier["prompt"][n]:
                n += 1
            best = max(best, n)
        self.queries += len(prompt)
        self.hits += best

    async def _respond(self, payload, writer):
        self._count_prefix(payload["prompt"])
        self.payloads.append(payload)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

        async def event(data):
            body = f"data: {data}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(body), body))
            await writer.drain()

        for i in range(payload["max_tokens"]):
            await asyncio.sleep(self.first_s if i == 0 else self.gap_s)
            choice = {"index": 0, "text": f" t{i}"}
            if payload.get("return_token_ids"):
                choice["token_ids"] = [len(payload["prompt"]) * 10 + i]
            await event(json.dumps({"choices": [choice]}))
        await event(json.dumps({"choices": [], "usage": {"prompt_tokens": len(payload["prompt"]),
                                                          "completion_tokens": payload["max_tokens"]}}))
        await event("[DONE]")
        self.in_flight -= 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def test_client_end_to_end(bench, tmp_path, capsys):
    result_file = tmp_path / "out.json"
    with StreamingServer(first_s=0.05, gap_s=0.01) as server:
        t0 = time.perf_counter()
        result = bench.main(["--base-url", server.url, "--model", "m", "--num-prompts", "6", "--input-len", "9",
                             "--output-len", "4", "--concurrency", "2", "--warmup", "2", "--vocab-size", "500",
                             "--result-file", str(result_file)])
        wall = time.perf_counter() - t0
    assert len(server.payloads) == 8  # 2 warm-up + 6 counted
    assert result["completed"] == 6 and result["failed"] == 0  # warm-up not counted
    assert server.peak == 2  # the concurrency cap holds
    for p in server.payloads:
        assert len(p["prompt"]) == 9 and all(100 <= t < 500 for t in p["prompt"])
        assert p["max_tokens"] == 4 and p["ignore_eos"] is True and p["stream"] is True
    assert result["total_input_tokens"] == 54 and result["total_output_tokens"] == 24
    # timings measured by the client bracket what the server did
    assert 50 <= result["mean_ttft_ms"] < 50 + 200
    assert 10 <= result["median_itl_ms"] < 10 + 100
    assert result["mean_e2el_ms"] >= 50 + 3 * 10
    assert result["mean_tpot_ms"] == pytest.approx((result["mean_e2el_ms"] - result["mean_ttft_ms"]) / 3, rel=0.05)
    # 6 requests of >= 80 ms, two at a time: at least 3 rounds, and the warm-up is outside the clock
    assert 3 * 0.08 <= result["duration"] < wall
    saved = json.loads(result_file.read_text())
    assert saved["completed"] == 6 and len(saved["requests"]) == 6
    assert saved["args"]["request_rate"] == "inf"
    assert "Output token throughput" in capsys.readouterr().out


def test_client_processes_share_the_concurrency(bench):
    """--client-procs: each process runs its share of the prompts under its share of the cap."""
    with StreamingServer(first_s=0.05, gap_s=0.02) as server:
        result = bench.main(["--base-url", server.url, "--model", "m", "--num-prompts", "8", "--input-len", "5",
                             "--output-len", "5", "--concurrency", "4", "--client-procs", "2", "--warmup", "1",
                             "--vocab-size", "500"])
    assert result["completed"] == 8 and result["failed"] == 0 and len(server.payloads) == 9
    assert server.peak == 4  # 2 + 2 in flight, never more
    assert result["total_output_tokens"] == 40
    assert 0.05 <= result["mean_ttft_ms"] / 1000 < 0.5
    assert 2 * (0.05 + 4 * 0.02) <= result["duration"] < 5  # two rounds of four


def test_client_reports_failures(bench):
    # nothing listens on port 1: every request fails, none is counted as completed
    result = bench.main(["--base-url", "http://127.0.0.1:1", "--model", "m", "--num-prompts", "2",
                         "--input-len", "3", "--output-len", "2", "--warmup", "0", "--timeout", "5"])
    assert result["completed"] == 0 and result["failed"] == 2


def test_client_multi_turn_shared_prefix_end_to_end(bench, tmp_path, capsys):
    with StreamingServer(first_s=0.01, gap_s=0.005) as server:
        result = bench.main(["--base-url", server.url, "--model", "m", "--num-prompts", "4", "--input-len", "3",
                             "--output-len", "2", "--concurrency", "2", "--warmup", "1", "--vocab-size", "500",
                             "--shared-prefix-groups", "2", "--shared-prefix-len", "6", "--multi-turn", "3",
                             "--result-file", str(tmp_path / "out.json")])
    turns = bench.conversation_turns(4, 3, 500, seed=0, groups=2, prefix_len=6, turns=3)
    warm, measured = server.payloads[0], server.payloads[1:]
    assert "return_token_ids" in warm and len(measured) == 12
    assert result["completed"] == 12 and result["failed"] == 0
    # each conversation's turns in order: history (prompts and returned ids) plus the new turn
    by_first = {tuple(p["prompt"][:9]): [] for p in measured if len(p["prompt"]) == 9}
    for p in measured:
        by_first[tuple(p["prompt"][:9])].append(p["prompt"])
    assert sorted(by_first) == sorted(tuple(c[0]) for c in turns)
    for conv in turns:
        prompts = by_first[tuple(conv[0])]
        history = []
        for turn, prompt in zip(conv, prompts):
            assert prompt == history + turn
            history = prompt + [len(prompt) * 10, len(prompt) * 10 + 1]
    assert result["total_input_tokens"] == sum(len(p["prompt"]) for p in measured)
    # the server's counters over the measured run: the warm-up's lookup (the first, so no hit) excluded
    queries = sum(len(p["prompt"]) for p in measured)
    assert server.queries == queries + len(warm["prompt"])
    assert (result["prefix_cache_queries"], result["prefix_cache_hits"]) == (queries, server.hits)
    assert result["prefix_cache_hit_rate"] == pytest.approx(server.hits / queries)
    assert server.hits > 4 * 6  # later turns and the second member of each group hit
    assert "Prefix cache hit rate" in capsys.readouterr().out


def test_shared_prefix_options_go_together(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", "--shared-prefix-groups", "2"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", "--multi-turn", "0"])


def test_goodput_counts_requests_within_both_slos(bench):
    R = bench.RequestOutput
    outputs = [R(prompt_len=1, success=True, ttft=0.1, latency=0.5, output_tokens=5),  # TPOT 100 ms
               R(prompt_len=1, success=True, ttft=0.3, latency=0.5, output_tokens=5),  # TTFT over
               R(prompt_len=1, success=True, ttft=0.1, latency=1.3, output_tokens=5),  # TPOT 300 ms: over
               R(prompt_len=1, success=False, error="x")]
    m = bench.compute_metrics(outputs, duration=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert (m["good_requests"], m["goodput"]) == (1, 0.5)
    assert bench.compute_metrics(outputs, duration=2.0, slo_ttft_ms=200)["good_requests"] == 2
    assert "goodput" not in bench.compute_metrics(outputs, duration=2.0)
    assert bench.compute_metrics(outputs, duration=2.0)["p95_ttft_ms"] == pytest.approx(100 + 0.9 * 200)


def test_response_format_from_a_file_and_fresh_schemas_never_repeat(bench):
    import pathlib

    path = pathlib.Path(bench.__file__).parent / "bench_schema.json"
    args = bench.parse_args(["--model", "m", "--response-format", f"@{path}", "--fresh-schemas"])
    assert args.response_format["type"] == "json_schema"
    schemas = [bench.fresh_schema(args)["json_schema"]["schema"] for _ in range(3)]
    names = [set(s["properties"]) for s in schemas]
    assert len({frozenset(n) for n in names}) == 3  # each request's schema is one the server has not seen
    assert all(n >= set(args.response_format["json_schema"]["schema"]["properties"]) for n in names)
    with pytest.raises(SystemExit):  # fresh schemas need a json_schema to vary
        bench.parse_args(["--model", "m", "--response-format", '{"type": "json_object"}', "--fresh-schemas"])


def test_chat_media_are_made_before_the_run_and_each_request_gets_its_own(bench, monkeypatch):
    """Images and clips are encoded by pregenerate, not while requests are sent (a PNG held the
    client's event loop for up to a third of a second), however many the run sends; a new one leaves
    the store once sent, repeated ones are shared."""
    import argparse

    bench_images = bench.bench_images
    ap = argparse.ArgumentParser()
    bench_images.add_args(ap)
    args = ap.parse_args(["--images-per-request", "2", "--image-size", "16", "--audio-per-request", "1",
                          "--audio-seconds", "0.01"])
    args.seed, args.model = 5, "m"
    bench_images.pregenerate(args, 80)

    def no_encoding(*a):
        raise AssertionError("a medium was encoded while sending")

    monkeypatch.setattr(bench_images.np.random, "default_rng", no_encoding)
    payloads = [bench_images.chat_payload(args, [1, 2], 4) for _ in range(80)]
    media = [json.dumps(p.get("image_url", p.get("input_audio"))) for pl in payloads for p in pl["messages"][0]["content"][:3]]
    assert len(set(media)) == 240  # 80 requests x (2 images + 1 clip), all distinct
    assert not bench_images._urls and not bench_images._clips  # each sent once, then dropped
    monkeypatch.undo()
    args.repeat_images = True
    bench_images.pregenerate(args, 2)
    twice = [bench_images.chat_payload(args, [1], 4)["messages"][0]["content"][:2] for _ in range(2)]
    assert twice[0] == twice[1]


def test_copy_prompts_are_text_by_default_and_text_needs_the_tokenizer(bench):
    with pytest.raises(SystemExit):  # text copies are token ids of the served model's tokenizer: it must be named
        bench.parse_args(["--model", "m", "--copy-prompts"])
    args = bench.parse_args(["--model", "m", "--copy-prompts", "random"])
    assert args.copy_prompts == "random"
    args = bench.parse_args(["--model", "m", "--copy-prompts", "--tokenizer", "/x", "--num-prompts", "3"])
    assert args.copy_prompts == "text" and args.tokenizer == "/x"
    conversations, _, _ = bench.build_workload(bench.parse_args(
        ["--model", "m", "--copy-prompts", "random", "--input-len", "10", "--vocab-size", "500", "--num-prompts", "3"]))
    assert [len(c) for c in conversations] == [1, 1, 1] and all(p[:5] == p[5:] for [p] in conversations)
