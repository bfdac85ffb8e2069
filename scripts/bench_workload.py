"""The pure parts of scripts/bench_serving.py: the workload (random token prompts, shared-prefix
conversations, Poisson arrivals), the timing of one streamed response, and vLLM's benchmark_serving
metrics over all of them. No I/O, so the tests check them on synthetic input."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int, low: int = 100) -> list[list[int]]:
    """`num` prompts of exactly `input_len` token ids, uniform in [low, vocab_size) (low skips the
    special tokens most vocabularies put first)."""
    if vocab_size <= low:
        raise ValueError(f"--vocab-size {vocab_size} must exceed {low}")
    rng = np.random.default_rng(seed)
    return rng.integers(low, vocab_size, size=(num, input_len)).tolist()


SYSTEM_PROMPT_SEED = 2  # seed offsets of the streams besides the first turns (seed) and warm-up (seed + 1)
LATER_TURNS_SEED = 3


def conversation_turns(num: int, input_len: int, vocab_size: int, seed: int, groups: int = 0,
                       prefix_len: int = 0, turns: int = 1) -> list[list[list[int]]]:
    """Per conversation, the new tokens of each of its `turns` user turns. First turns are
    `random_prompts` (one turn without groups is the plain workload), conversation i's behind group
    i % groups's system prompt when groups > 0; later turns are fresh random tokens."""
    firsts = random_prompts(num, input_len, vocab_size, seed)
    if groups:
        systems = random_prompts(groups, prefix_len, vocab_size, seed + SYSTEM_PROMPT_SEED)
        firsts = [systems[i % groups] + first for i, first in enumerate(firsts)]
    later = random_prompts(num * (turns - 1), input_len, vocab_size, seed + LATER_TURNS_SEED)
    return [[first] + later[i * (turns - 1) : (i + 1) * (turns - 1)] for i, first in enumerate(firsts)]


# the server's prefix-cache (queries, hits), if it reports them, then with a host KV tier (llaunch's
# cache.cpu_tokens) its (host hits, tokens promoted, tokens demoted, tokens fetched from other dp replicas)
CacheCounts = Optional[tuple[float, ...]]
HOST_TIER_SERIES = ("prefix_cache_host_hits", "kv_promoted_tokens", "kv_demoted_tokens", "dp_fetched_tokens")


def series_totals(metrics_text: str, series: Sequence[str], every: bool = True) -> Optional[tuple[float, ...]]:
    """Each `<prefix>:<name>_total` counter of `series` from Prometheus text, summed over its labels, in
    `series` order; None when `every` and one is not exposed (a missing one counts 0 otherwise)."""
    found, seen = dict.fromkeys(series, 0.0), set()
    pattern = r"^\w+:(%s)_total(?:\{[^}]*\})? (\S+)$" % "|".join(map(re.escape, series))
    for name, value in re.findall(pattern, metrics_text, re.M):
        found[name] += float(value)
        seen.add(name)
    return tuple(found.values()) if seen == set(series) or not every else None


async def fetch_metrics(client: Any, api_key: Optional[str]) -> Optional[str]:
    """The server's /metrics text, or None (a server without it: no figures, not a failed benchmark)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get("/metrics", headers=headers)
    except Exception:
        return None
    return resp.text if resp.status_code == 200 else None


def prefix_cache_counts(metrics_text: str) -> CacheCounts:
    """(queries, hits) in tokens from Prometheus text, summed over series; None when not exposed."""
    base = series_totals(metrics_text, ("prefix_cache_queries", "prefix_cache_hits"))
    if base is None:
        return None
    tiered = re.search(r"^\w+:prefix_cache_host_hits_total", metrics_text, re.M) is not None
    return base + (series_totals(metrics_text, HOST_TIER_SERIES, every=False) if tiered else ())


def arrival_offsets(num: int, request_rate: float, seed: int) -> list[float]:
    """Send times relative to the start: all at 0 for an infinite rate, else a Poisson process."""
    if math.isinf(request_rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num)
    gaps[0] = 0.0  # the first request goes out at once
    return np.cumsum(gaps).tolist()


@dataclass
class RequestOutput:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    generated_text: str = ""
    output_ids: list[int] = field(default_factory=list)  # when the server returns them (multi-turn)
    error: str = ""


class StreamTimer:
    """Consumes one response's server-sent-event lines with their arrival times (perf_counter)."""

    def __init__(self, prompt_len: int, start: float):
        self.out = RequestOutput(prompt_len=prompt_len)
        self.start = start
        self.last: Optional[float] = None
        self.chunks = 0
        self.usage_tokens: Optional[int] = None

    def on_line(self, line: str, now: float) -> None:
        line = line.strip()
        if not line.startswith("data:"):
            return  # blank separators, ": comments", event:/id: fields
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        data = json.loads(payload)
        if "error" in data:
            self.out.error = json.dumps(data["error"])[:500]
            return
        if data.get("choices"):
            if self.last is None:
                self.out.ttft = now - self.start
            else:
                self.out.itl.append(now - self.last)
            self.last = now
            self.chunks += 1
            self.out.generated_text += data["choices"][0].get("text") or ""
            self.out.output_ids += data["choices"][0].get("token_ids") or []
        if data.get("usage"):
            self.usage_tokens = data["usage"].get("completion_tokens")

    def finish(self, error: str = "") -> RequestOutput:
        out = self.out
        out.error = error or out.error
        out.success = self.last is not None and not out.error
        if self.last is not None:
            out.latency = self.last - self.start
        out.output_tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        if self.last is None and not out.error:
            out.error = "never received a chunk with a choice"
        return out


def _stats_ms(name: str, values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float) if len(values) else np.zeros(1)  # vLLM: `values or 0`
    return {f"mean_{name}_ms": float(arr.mean() * 1000), f"median_{name}_ms": float(np.median(arr) * 1000),
            f"std_{name}_ms": float(arr.std() * 1000), f"p95_{name}_ms": float(np.percentile(arr, 95) * 1000),
            f"p99_{name}_ms": float(np.percentile(arr, 99) * 1000)}


def meets_slo(o: RequestOutput, slo_ttft_ms: Optional[float], slo_tpot_ms: Optional[float]) -> bool:
    """Did the request succeed within the service-level objectives (vLLM's goodput definition)?"""
    tpot = (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0
    return o.success and (slo_ttft_ms is None or o.ttft * 1000 <= slo_ttft_ms) \
        and (slo_tpot_ms is None or tpot * 1000 <= slo_tpot_ms)


def compute_metrics(outputs: Sequence[RequestOutput], duration: float, slo_ttft_ms: Optional[float] = None,
                    slo_tpot_ms: Optional[float] = None) -> dict[str, Any]:
    """vLLM's benchmark_serving figures; with an SLO also goodput: requests per second that met it."""
    ok = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    result: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    result.update(_stats_ms("ttft", [o.ttft for o in ok]))
    result.update(_stats_ms("tpot", tpots))
    result.update(_stats_ms("itl", [gap for o in ok for gap in o.itl]))
    result.update(_stats_ms("e2el", [o.latency for o in ok]))
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(o, slo_ttft_ms, slo_tpot_ms) for o in outputs)
        result.update(good_requests=good, goodput=good / duration, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    return result
