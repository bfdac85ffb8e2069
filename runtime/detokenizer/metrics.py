"""The metrics hub: vLLM's serving metrics (same names, meanings and buckets, `llaunch:` prefix).

The detokenizer is the one process that sees every request's tokens with their timing, so it owns
these series and ships the rendered text to the frontends, which serve it at /metrics.

Labels: every series has `model_name` (like vLLM). The scheduler gauges also have `dp_rank`, one
series per data-parallel replica (vLLM's per-engine label); they are not summed.

Prompt cache: `kv_cache_usage_perc` counts the slots requests hold, not cache entries that can be
evicted (vLLM's meaning: those are free blocks to it); `prefix_cache_usage_perc` is the share of slots
the radix tree holds; `prefix_cache_queries` / `prefix_cache_hits` count prompt tokens looked up and
found (vLLM's counters), summed over replicas.
"""
from __future__ import annotations

from llaunch.runtime.detokenizer.prometheus import Counter, Gauge, Histogram, render
from llaunch.runtime.ipc.messages import RouterStats

PREFIX = "llaunch:"

# vLLM v1 (vllm/v1/metrics/loggers.py) bucket boundaries.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")  # exposed from the start, at zero, as vLLM does


class MetricsHub:
    """Records request events and scheduler stats; `render()` gives the Prometheus text."""

    def __init__(self, model_name: str, dp: int = 1):
        self.model = (model_name,)
        m = ("model_name",)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS, m)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS, m)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS, m)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", m)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Number of generation tokens processed.", m)
        self.request_success = Counter(PREFIX + "request_success",
                                       "Count of successfully processed requests.", m + ("finished_reason",))
        ranked = m + ("dp_rank",)
        self.running = Gauge(PREFIX + "num_requests_running",
                             "Number of requests in model execution batches.", ranked)
        self.waiting = Gauge(PREFIX + "num_requests_waiting",
                             "Number of requests waiting to be processed.", ranked)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              ranked)
        self.prefix_usage = Gauge(PREFIX + "prefix_cache_usage_perc",
                                  "Share of KV-cache slots held by the prompt cache. 1 means 100 percent.", ranked)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", m)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.", m)
        self.stalled = Gauge(PREFIX + "engine_stalled",
                             "1 while the replica's engine is stalled (a step overdue, a worker gone).", ranked)
        self.stalls = Counter(PREFIX + "engine_stalls", "Stalls the health monitor saw, per replica.", ranked)
        for h in (self.ttft, self.itl, self.e2e):
            h.touch(self.model)
        for c in (self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits):
            c.inc(self.model, 0)
        for reason in FINISH_REASONS:
            self.request_success.inc(self.model + (reason,), 0)
        self._stats: dict[int, RouterStats] = {}
        for rank in range(dp):
            self.record_stats(RouterStats(time=0.0, running=0, waiting=0, kv_used=0, kv_total=0, dp_rank=rank))

    # ---- request events (times in seconds since the epoch, as the frontend stamps arrival) -------

    def first_token(self, arrival_time: float, now: float, prompt_tokens: int) -> None:
        """Prefill is done: the prompt counts as processed and the first token's latency is known."""
        self.ttft.observe(self.model, now - arrival_time)
        self.prompt_tokens.inc(self.model, prompt_tokens)

    def token_gap(self, seconds: float) -> None:
        """Time between two outputs of one request (one per decode step, as vLLM counts it)."""
        self.itl.observe(self.model, seconds)

    def generated(self, tokens: int) -> None:
        self.generation_tokens.inc(self.model, tokens)

    def finished(self, arrival_time: float, now: float, reason: str) -> None:
        self.e2e.observe(self.model, now - arrival_time)
        self.request_success.inc(self.model + (reason,))

    # ---- scheduler state ------------------------------------------------------------------------

    def record_stats(self, stats: RouterStats) -> None:
        before = self._stats.get(stats.dp_rank)
        self._stats[stats.dp_rank] = stats
        rank = self.model + (str(stats.dp_rank),)
        self.running.set(rank, stats.running)
        self.waiting.set(rank, stats.waiting)
        total = stats.kv_total or 1  # zero before the router's first report
        self.kv_usage.set(rank, (stats.kv_used - stats.kv_evictable) / total)
        self.prefix_usage.set(rank, stats.prefix_cache_tokens / total)
        # the router reports totals since its start; the counters add what is new
        self.prefix_queries.inc(self.model, stats.prefix_cache_queries - (before.prefix_cache_queries if before else 0))
        self.prefix_hits.inc(self.model, stats.prefix_cache_hits - (before.prefix_cache_hits if before else 0))
        self.stalled.set(rank, float(stats.stalled))
        self.stalls.inc(rank, stats.stalls - (before.stalls if before else 0))

    @property
    def num_running(self) -> int:
        return sum(s.running for s in self._stats.values())

    @property
    def num_waiting(self) -> int:
        return sum(s.waiting for s in self._stats.values())

    @property
    def stalled_replicas(self) -> list[int]:
        return sorted(rank for rank, s in self._stats.items() if s.stalled)

    def render(self) -> str:
        return render([self.running, self.waiting, self.kv_usage, self.prefix_usage, self.prefix_queries,
                       self.prefix_hits, self.stalled, self.stalls, self.prompt_tokens,
                       self.generation_tokens, self.request_success, self.ttft, self.itl, self.e2e])
