"""The metrics hub: vLLM's serving metrics (same names, meanings and buckets; `llaunch:` prefix by default).

The prefix is server.metrics_prefix: `vllm` names every series `vllm:*`, so dashboards and autoscalers
written for vLLM read the series both servers have unchanged (tests/unit/test_metrics_exposition.py lists
them); llaunch's own series get the same prefix, so one dashboard (deploy/grafana/llaunch.json, its
`metric_prefix` variable) reads either. vLLM's example dashboard also reads gpu_cache_usage_perc and
time_per_output_token_seconds (vLLM's older names of kv_cache_usage_perc and inter_token_latency_seconds)
and request_max_num_generation_tokens (the longest of n samples), which have no series here.

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

from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from llaunch.runtime import metrics_exposition
from llaunch.runtime.ipc.messages import RouterStats

disable_created_metrics()  # no `_created` series: vLLM's dashboards do not read them

# vLLM v1 (vllm/v1/metrics/loggers.py) bucket boundaries.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")  # exposed from the start, at zero, as vLLM does


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to the context: 1, 2, 5, 10, 20, 50, ... ≤ max_model_len."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class MetricsHub:
    """Records request events and scheduler stats in a prometheus_client registry of its own;
    `render()` gives the Prometheus text the frontends serve."""

    def __init__(self, model_name: str, dp: int = 1, max_model_len: int = 32768, prefix: str = "llaunch:"):
        """`prefix`: of every series' name (server.metrics_prefix and a colon)."""
        self.registry = r = CollectorRegistry()
        self.model = (model_name,)
        m = ["model_name"]

        def histogram(name: str, doc: str, buckets, labels=m) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.prompt_tokens = Counter(prefix + "prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter(prefix + "generation_tokens", "Number of generation tokens processed.", m,
                                         registry=r)
        self.request_success = Counter(prefix + "request_success", "Count of successfully processed requests.",
                                       m + ["finished_reason"], registry=r)
        ranked = m + ["dp_rank"]
        self.running = Gauge(prefix + "num_requests_running", "Number of requests in model execution batches.",
                             ranked, registry=r)
        self.waiting = Gauge(prefix + "num_requests_waiting", "Number of requests waiting to be processed.",
                             ranked, registry=r)
        self.kv_usage = Gauge(prefix + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              ranked, registry=r)
        self.prefix_usage = Gauge(prefix + "prefix_cache_usage_perc",
                                  "Share of KV-cache slots held by the prompt cache. 1 means 100 percent.", ranked,
                                  registry=r)
        self.prefix_queries = Counter(prefix + "prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", m, registry=r)
        self.prefix_hits = Counter(prefix + "prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.", m, registry=r)
        # the host KV tier (cache.cpu_tokens): GPU-tier hits are prefix_cache_hits less these
        self.host_hits = Counter(prefix + "prefix_cache_host_hits",
                                 "Prefix cache hits found in the host KV tier, in tokens.", m, registry=r)
        self.promoted = Counter(prefix + "kv_promoted_tokens", "Tokens of KV copied from the host tier to the GPU.",
                                m, registry=r)
        self.demoted = Counter(prefix + "kv_demoted_tokens", "Tokens of KV copied from the GPU to the host tier.",
                               m, registry=r)
        self.dp_fetched = Counter(prefix + "dp_fetched_tokens", "Tokens of KV copied from another dp replica's "
                                  "host tier instead of computed (cache.dp_fetch).", m, registry=r)
        self.host_usage = Gauge(prefix + "host_kv_cache_usage_perc",
                                "Share of the host KV tier's slots the prompt cache holds. 1 means 100 percent.",
                                ranked, registry=r)
        self.stalled = Gauge(prefix + "engine_stalled",
                             "1 while the replica's engine is stalled (a step overdue, a worker gone).", ranked,
                             registry=r)
        self.stalls = Counter(prefix + "engine_stalls", "Stalls the health monitor saw, per replica.", ranked,
                              registry=r)
        # speculative decoding (vLLM's series): proposals verified, their tokens, and those accepted
        self.spec_drafts = Counter(prefix + "spec_decode_num_drafts", "Proposals verified (one per row and step).",
                                   m, registry=r)
        self.spec_draft_tokens = Counter(prefix + "spec_decode_num_draft_tokens", "Tokens proposed.", m, registry=r)
        self.spec_accepted = Counter(prefix + "spec_decode_num_accepted_tokens", "Proposed tokens accepted.", m,
                                     registry=r)
        self.spec_accepted_per_pos = Counter(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                             "Proposals whose token at this position (0 first) was accepted.",
                                             [*m, "position"], registry=r)
        self.spec_backoffs = Counter(prefix + "spec_decode_num_backoffs", "Rows that stopped proposing for a while "
                                     "because their proposals kept being rejected.", m, registry=r)
        self.spec_chained = Counter(prefix + "spec_decode_num_chained", "Verifies planned while the row's previous "
                                    "verify was out, on the verdict they assumed (spec.chain).", m, registry=r)
        self.spec_voided = Counter(prefix + "spec_decode_num_voided", "Chained verifies dropped: the verdict they "
                                   "assumed did not come.", m, registry=r)
        # multimodal models: images looked up in the visual servers' embed cache (vLLM's mm_cache series),
        # and those encoded (a miss joining an encode already under way is not encoded again)
        self.mm_queries = Counter(prefix + "mm_cache_queries", "Images looked up in the embed cache.", m, registry=r)
        self.mm_hits = Counter(prefix + "mm_cache_hits", "Images found in the embed cache (not encoded again).", m,
                               registry=r)
        self.images_encoded = Counter(prefix + "images_encoded", "Images the visual servers encoded.", m, registry=r)
        # vLLM's series, for its dashboards; always 0 here: admission reserves a request's KV up front
        self.preemptions = Counter(prefix + "num_preemptions", "Cumulative number of preemption from the engine.",
                                   m, registry=r)
        for family in (self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time, self.decode_time,
                       self.inference_time, self.request_prompt_tokens, self.request_generation_tokens,
                       self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits,
                       self.preemptions, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.spec_backoffs,
                       self.spec_chained, self.spec_voided,
                       self.mm_queries, self.mm_hits, self.images_encoded):
            family.labels(*self.model)  # every series exists from the start, at zero
        for reason in FINISH_REASONS:
            self.request_success.labels(*self.model, reason)
        self._stats: dict[int, RouterStats] = {}
        self._reported: set[int] = set()  # replicas whose router reported: it serves once its workers are ready
        for rank in range(dp):
            self.record_stats(RouterStats(time=0.0, running=0, waiting=0, kv_used=0, kv_total=0, dp_rank=rank),
                              reported=False)

    # ---- request events (times in seconds since the epoch, as the frontend stamps arrival) -------

    def first_token(self, arrival_time: float, now: float, prompt_tokens: int,
                    scheduled_time: float = 0.0) -> None:
        """Prefill is done: the prompt counts as processed and the first token's latency is known;
        `scheduled_time` (the router's, when the request got its row) splits it into queue and prefill."""
        self.ttft.labels(*self.model).observe(now - arrival_time)
        self.prompt_tokens.labels(*self.model).inc(prompt_tokens)
        if scheduled_time:
            self.queue_time.labels(*self.model).observe(max(scheduled_time - arrival_time, 0.0))
            self.prefill_time.labels(*self.model).observe(max(now - scheduled_time, 0.0))

    def token_gap(self, seconds: float) -> None:
        """Time between two outputs of one request (one per decode step, as vLLM counts it)."""
        self.itl.labels(*self.model).observe(seconds)

    def generated(self, tokens: int) -> None:
        self.generation_tokens.labels(*self.model).inc(tokens)

    def finished(self, arrival_time: float, now: float, reason: str, prompt_tokens: int = 0,
                 output_tokens: int = 0, first_token_time: float = 0.0, scheduled_time: float = 0.0) -> None:
        self.e2e.labels(*self.model).observe(now - arrival_time)
        self.request_success.labels(*self.model, reason).inc()
        if first_token_time:  # a request that produced tokens: its phases and sizes
            self.decode_time.labels(*self.model).observe(now - first_token_time)
            self.request_prompt_tokens.labels(*self.model).observe(prompt_tokens)
            self.request_generation_tokens.labels(*self.model).observe(output_tokens)
            if scheduled_time:
                self.inference_time.labels(*self.model).observe(max(now - scheduled_time, 0.0))

    # ---- scheduler state ------------------------------------------------------------------------

    def record_stats(self, stats: RouterStats, reported: bool = True) -> None:
        if reported:
            self._reported.add(stats.dp_rank)
        before = self._stats.get(stats.dp_rank)
        self._stats[stats.dp_rank] = stats
        rank = self.model + (str(stats.dp_rank),)
        self.running.labels(*rank).set(stats.running)
        self.waiting.labels(*rank).set(stats.waiting)
        total = stats.kv_total or 1  # zero before the router's first report
        self.kv_usage.labels(*rank).set((stats.kv_used - stats.kv_evictable) / total)
        self.prefix_usage.labels(*rank).set(stats.prefix_cache_tokens / total)
        # the router reports totals since its start; the counters add what is new
        self.prefix_queries.labels(*self.model).inc(
            stats.prefix_cache_queries - (before.prefix_cache_queries if before else 0))
        self.prefix_hits.labels(*self.model).inc(stats.prefix_cache_hits - (before.prefix_cache_hits if before else 0))
        self.host_hits.labels(*self.model).inc(stats.host_cache_hits - (before.host_cache_hits if before else 0))
        self.promoted.labels(*self.model).inc(stats.kv_promoted - (before.kv_promoted if before else 0))
        self.demoted.labels(*self.model).inc(stats.kv_demoted - (before.kv_demoted if before else 0))
        self.dp_fetched.labels(*self.model).inc(stats.dp_fetched - (before.dp_fetched if before else 0))
        self.host_usage.labels(*rank).set(stats.host_cache_tokens / (stats.host_cache_slots or 1))
        self.stalled.labels(*rank).set(float(stats.stalled))
        self.stalls.labels(*rank).inc(stats.stalls - (before.stalls if before else 0))
        for counter, field in ((self.spec_drafts, "spec_verify_rows"), (self.spec_draft_tokens, "spec_proposed"),
                               (self.spec_accepted, "spec_accepted"), (self.spec_backoffs, "spec_backoffs"),
                               (self.spec_chained, "spec_chained"), (self.spec_voided, "spec_voided"),
                               (self.mm_queries, "mm_cache_queries"),
                               (self.mm_hits, "mm_cache_hits"), (self.images_encoded, "images_encoded")):
            counter.labels(*self.model).inc(getattr(stats, field) - (getattr(before, field) if before else 0))
        earlier = before.spec_accepted_per_pos if before else []
        for pos, count in enumerate(stats.spec_accepted_per_pos):
            self.spec_accepted_per_pos.labels(*self.model, str(pos)).inc(count - (earlier[pos] if pos < len(earlier) else 0))

    @property
    def num_running(self) -> int:
        return sum(s.running for s in self._stats.values())

    @property
    def num_waiting(self) -> int:
        return sum(s.waiting for s in self._stats.values())

    @property
    def stalled_replicas(self) -> list[int]:
        return sorted(rank for rank, s in self._stats.items() if s.stalled)

    @property
    def loading_replicas(self) -> list[int]:
        """Replicas whose router has not reported yet: it reports only once every worker rank has
        loaded and warmed up (runtime/router/process.py wait_for_workers)."""
        return sorted(set(self._stats) - self._reported)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, url: str) -> None:
        """Also serve these series at `url` (server.metrics_port) from a daemon thread, without the API
        key: Prometheus scrapes then share neither the API's port nor its auth. A port that cannot be
        bound raises here, so the detokenizer fails its start."""
        where = urlsplit(url)
        metrics_exposition.serve(where.hostname, where.port, self.render)
