"""scripts/bench_serving.py's result table (rich): the request and token figures, vLLM's latency
statistics, and what the server reports of its prompt cache, host KV tier, speculative decoding and
visual servers."""
from __future__ import annotations

import argparse
from typing import Any

import bench_images
from bench_spec import spec_rows


def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Serving benchmark: {args.model} @ {args.base_url}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("Successful requests", result["completed"], "d"), ("Failed requests", result["failed"], "d"),
            ("Max concurrency", args.concurrency, "d"), ("Request rate (req/s)", args.request_rate, ".2f"),
            ("Benchmark duration (s)", result["duration"], ".2f"),
            ("Total input tokens", result["total_input_tokens"], "d"),
            ("Total generated tokens", result["total_output_tokens"], "d"),
            ("Request throughput (req/s)", result["request_throughput"], ".2f"),
            ("Output token throughput (tok/s)", result["output_throughput"], ".2f"),
            ("Total token throughput (tok/s)", result["total_token_throughput"], ".2f")]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        rows += [(f"{stat.capitalize() if stat != 'p99' else 'P99'} {label} (ms)", result[f"{stat}_{key}_ms"], ".2f")
                 for stat in ("mean", "median", "p95", "p99")]
    if args.shared_prefix_groups:
        groups = f"{args.shared_prefix_groups} x {args.shared_prefix_len}"
        rows.insert(3, ("Shared-prefix groups x tokens", groups, "s"))
    if args.multi_turn > 1:
        rows.insert(3, ("Turns per conversation", args.multi_turn, "d"))
    if "prefix_cache_hit_rate" in result:
        rows.append(("Prefix cache hit rate (%)", 100 * result["prefix_cache_hit_rate"], ".2f"))
    if "host_cache_hits" in result:
        queries = result["prefix_cache_queries"] or 1
        rows += [("GPU-tier hits (% of prompt tokens)", 100 * result["gpu_cache_hits"] / queries, ".2f"),
                 ("host-tier hits (% of prompt tokens)", 100 * result["host_cache_hits"] / queries, ".2f"),
                 ("KV tokens promoted / demoted", f"{result['kv_promoted_tokens']:.0f} / {result['kv_demoted_tokens']:.0f}", "s")]
        if result.get("dp_fetched_tokens"):
            rows.append(("KV tokens fetched from other dp replicas", result["dp_fetched_tokens"], ".0f"))
    rows += spec_rows(result)  # the server's speculative decoding, where it reports it
    rows += bench_images.image_rows(result)  # the visual servers' work, where the server reports it
    if "goodput" in result:
        rows.append(("Goodput (req/s within the SLOs)", result["goodput"], ".2f"))
    for label, value, fmt in rows:
        table.add_row(label, format(value, fmt))
    Console().print(table)
