"""launcher/report_sweep.py on synthetic sweeps: job directories as bench jobs write them, with bench.json
computed by scripts/bench_serving.py's own metric code from hand-made request timings."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import matplotlib.image
import pytest

from llaunch.launcher import report_sweep
from llaunch.launcher.bench_job import write_status

CONSTANT = ["bench=c1", "model=tiny-qwen2", "device=cpu"]


def bench_result(bench, ttft: float, gap: float, duration: float) -> dict:
    """Three requests of 5 output tokens, first token after `ttft` s, then one every `gap` s."""
    outs = [bench.RequestOutput(prompt_len=16, success=True, ttft=ttft * k, latency=ttft * k + 4 * gap,
                                itl=[gap] * 4, output_tokens=5) for k in (1, 2, 3)]
    return bench.compute_metrics(outs, duration)


def write_job(sweep: Path, num: int, overrides: list[str], result: dict | None, reason: str = "") -> None:
    job = sweep / str(num)
    write_status(job, {"status": "ok" if result else "failed", "reason": reason, "overrides": overrides,
                       "job_num": num})
    (job / "server").mkdir()  # the server's own run dir: not a job
    if result:
        (job / "bench.json").write_text(json.dumps(result))


def grid(bench, sweep: Path, speedup: float = 1.0) -> dict[tuple[str, str], dict]:
    """rows ∈ {4, 16, 64} × c ∈ {1, 8}; faster with more rows and less concurrency."""
    results = {}
    for num, (rows, c) in enumerate(itertools.product(("4", "16", "64"), ("1", "8"))):
        result = bench_result(bench, ttft=0.01 * int(c) / speedup, gap=0.002 * int(c) / speedup,
                              duration=100 / int(rows) / speedup)
        write_job(sweep, num, [*CONSTANT, f"router.max_running_requests={rows}", f"bench.concurrency={c}"], result)
        results[(rows, c)] = result
    return results


def markdown_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    table = [line for line in path.read_text().splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    return split[0], split[2:]


def test_table_has_the_varying_overrides_then_the_headline_figures(bench, tmp_path):
    results = grid(bench, tmp_path)
    write_job(tmp_path, 6, [*CONSTANT, "router.max_running_requests=256", "bench.concurrency=1"], None,
              reason="the server exited before it was healthy (exit code 1):\nTraceback ...")
    jobs = report_sweep.load_sweep(tmp_path)
    assert [j.name for j in jobs] == [str(i) for i in range(7)] and [j.ok for j in jobs] == [True] * 6 + [False]
    assert report_sweep.varying_keys(jobs) == ["router.max_running_requests", "bench.concurrency"]

    assert report_sweep.main([str(tmp_path)]) == 0
    header, rows = markdown_rows(tmp_path / "report.md")
    keys = ["request_throughput", "output_throughput", "median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p95_itl_ms", "median_e2el_ms", "p99_e2el_ms", "failed"]
    assert header == ["router.max_running_requests", "bench.concurrency", "req/s", "output tok/s",
                      "TTFT median (ms)", "TTFT p95 (ms)", "TTFT p99 (ms)", "TPOT median (ms)", "TPOT p99 (ms)",
                      "ITL median (ms)", "ITL p95 (ms)", "latency median (ms)", "latency p99 (ms)", "errors"]
    assert [tuple(r[:2]) for r in rows] == list(results)  # the failed job has no row
    for row in rows:
        r = results[(row[0], row[1])]
        assert [float(x) for x in row[2:]] == pytest.approx([r[k] for k in keys], rel=1e-3, abs=0.51)
    assert rows[0][2:4] == ["0.120", "0.6"]  # 3 requests × 5 tokens in 25 s (hand-computed)
    assert dict(zip(header, rows[0]))["TPOT median (ms)"] == "2.00"  # TPOT = (latency - ttft) / 4 = gap
    text = (tmp_path / "report.md").read_text()
    assert "Failed jobs" in text and "router.max_running_requests=256" in text and "exit code 1" in text
    assert "Traceback" not in text  # the first line of the reason only


def test_plot_is_a_png_with_a_line_per_other_override(bench, tmp_path):
    grid(bench, tmp_path)
    jobs = report_sweep.load_sweep(tmp_path)
    path = report_sweep.plot_sweep(jobs, tmp_path / "plot.png")
    image = matplotlib.image.imread(path)
    assert image.shape == (400, 1650, 4) and image.std() > 0  # figures vs x, and throughput vs latency
    # categorical x axis and no other override: still a plot
    write_job(tmp_path / "cat", 0, ["bench=c1"], bench_result(bench, 0.01, 0.002, 10))
    write_job(tmp_path / "cat", 1, ["bench=c64"], bench_result(bench, 0.02, 0.004, 10))
    path = report_sweep.plot_sweep(report_sweep.load_sweep(tmp_path / "cat"), tmp_path / "cat.png")
    assert matplotlib.image.imread(path).shape == (400, 1650, 4)


def test_plot_lines_follow_the_chosen_x(bench, tmp_path, monkeypatch):
    grid(bench, tmp_path)
    import matplotlib.axes

    plotted = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, xs, ys, **kw: plotted.append((list(xs), kw.get("label"))) or original(
                            self, xs, ys, **kw))
    report_sweep.plot_sweep(report_sweep.load_sweep(tmp_path), tmp_path / "a.png")
    assert plotted[:2] == [([4, 16, 64], "bench.concurrency=1"), ([4, 16, 64], "bench.concurrency=8")]
    plotted.clear()
    report_sweep.plot_sweep(report_sweep.load_sweep(tmp_path), tmp_path / "b.png", x_key="bench.concurrency")
    assert [label for _, label in plotted[:3]] == [f"router.max_running_requests={r}" for r in (4, 16, 64)]
    assert plotted[0][0] == [1, 8]


def test_compare_gives_after_over_before_ratios(bench, tmp_path):
    before = grid(bench, tmp_path / "before")
    after = grid(bench, tmp_path / "after", speedup=2.0)
    (tmp_path / "after" / "5" / "status.json").unlink()  # (64, 8) only in before
    (tmp_path / "after" / "5" / "bench.json").unlink()
    assert report_sweep.main([str(tmp_path / "before"), str(tmp_path / "after"), "--out", str(tmp_path)]) == 0
    header, rows = markdown_rows(tmp_path / "compare.md")
    assert header[:2] == ["router.max_running_requests", "bench.concurrency"]
    assert len(rows) == 5
    for row in rows:
        b, a = before[(row[0], row[1])], after[(row[0], row[1])]
        keys = ["request_throughput", "output_throughput", "median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms",
                "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p95_itl_ms", "median_e2el_ms", "p99_e2el_ms"]
        assert row[2:] == [f"{a[k] / b[k]:.2f}×" for k in keys]
        assert row[2:] == ["2.00×"] * 2 + ["0.50×"] * 9  # twice as fast everywhere
    assert "only in before: router.max_running_requests=64 bench.concurrency=8" in (tmp_path / "compare.md").read_text()


def test_cli_refuses_what_it_cannot_report(tmp_path):
    (tmp_path / "empty").mkdir()
    assert report_sweep.main([str(tmp_path / "empty")]) == 1
    with pytest.raises(SystemExit) as e:
        report_sweep.main([str(tmp_path / "missing")])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        report_sweep.main([str(tmp_path)] * 3)


def test_repeats_show_their_spread_and_slos_their_goodput(bench, tmp_path):
    runs = [bench.compute_metrics([bench.RequestOutput(prompt_len=16, success=True, ttft=0.1 * k, latency=0.5,
                                                       itl=[0.1] * 4, output_tokens=5)], duration=d,
                                  slo_ttft_ms=150)
            for k, d in ((1, 2.0), (2, 2.5), (1, 2.2))]
    slowest = min(runs, key=lambda r: r["output_throughput"])
    write_job(tmp_path, 0, ["bench=c1", "bench.repeats=3", "router.max_running_requests=4"],
              {**slowest, "repeats": 3, "runs": runs})
    write_job(tmp_path, 1, ["bench=c1", "bench.repeats=3", "router.max_running_requests=8"], runs[0])
    assert report_sweep.main([str(tmp_path)]) == 0
    header, rows = markdown_rows(tmp_path / "report.md")
    cell = dict(zip(header, rows[0]))
    assert cell["output tok/s"] == "2.0 (2.0–2.5)"  # the slowest run, then the range of the three
    assert cell["TTFT median (ms)"] == "200.0 (100.0–200.0)"
    assert cell["goodput (req/s)"] == "0.000 (0.000–0.500)"  # TTFT 200 ms misses the 150 ms objective
    assert dict(zip(header, rows[1]))["output tok/s"] == "2.5"  # one run: no range
