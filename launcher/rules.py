"""Named rules over the resolved config: every start-up check, each with a message that names the keys,
their values and the fix. `check_all` runs them all, so a bad config lists every problem at once
(the registry and the runners are launcher/rule_registry.py's).

Ported from LightLLM's start-up (api_start.py / api_cli.py asserts) where the feature exists here,
plus ours (parallel layout, ports, modes). The model's rules are launcher/rules_model.py's, the memory
rule launcher/memory_plan.py's; importing this module registers them all. A rule for a feature
arrives with it.
"""
from __future__ import annotations

import os
import socket

from llaunch.launcher import gpus, memory_plan, rules_graph, rules_model, secrets  # noqa: F401 (they register rules too)
from llaunch.launcher import rules_score  # noqa: F401 (registers the score model's rules)
from llaunch.launcher import rules_spec  # noqa: F401 (speculative decoding's rules)
from llaunch.launcher import rules_server  # noqa: F401 (metric server and TGI API rules)
from llaunch.launcher import rules_quant  # noqa: F401 (quantized checkpoints, fp8 KV cache)
from llaunch.launcher import rules_moe  # noqa: F401 (mixture-of-experts models; MLP widths split over tp)
from llaunch.launcher import rules_visual  # noqa: F401 (the visual servers of multimodal models)
from llaunch.launcher import rules_effect  # noqa: F401 (a key set where nothing reads it)
from llaunch.launcher import rules_checkpoint  # noqa: F401 (checkpoints the worker cannot serve)
# check_all, warnings, pending and RULES are called through this module, which fills the registry
from llaunch.launcher.rule_registry import (NOTHING_CHANGED, RULES, check_all, get, pending, rule,  # noqa: F401
                                           warnings)
from llaunch.kernels.settings import INVARIANT_ROWS
from llaunch.runtime.config import Device, DType, LoadFormat, Mode, SpecMethod, WeightQuantization
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.moe_config import MOE_FAMILIES
from llaunch.runtime.models.heads import HeadLayout

_serves = rules_model.serves


# ---- memory and batching (LightLLM api_start.py) ------------------------------------------------


@rule()
def mem_fraction_in_range(cfg):
    f = cfg.cache.mem_fraction
    if not 0 < f < 1:
        yield ("cache.mem_fraction",), (f"cache.mem_fraction={f} is outside (0, 1): it is the share of GPU "
                                        "memory llaunch may use; set e.g. cache.mem_fraction=0.9")


@rule(needs=("router.batch_max_tokens",))
def batch_max_tokens_bounds(cfg):
    r, bmt = cfg.router, cfg.router.batch_max_tokens
    if r.chunked_prefill_size < 1:
        yield ("router.chunked_prefill_size",), (
            f"router.chunked_prefill_size={r.chunked_prefill_size} must be >= 1")
    elif r.chunked_prefill and bmt < r.chunked_prefill_size:
        yield ("router.batch_max_tokens", "router.chunked_prefill_size"), (
            f"router.batch_max_tokens={bmt} < router.chunked_prefill_size={r.chunked_prefill_size}: a step "
            f"must hold one prefill chunk; raise router.batch_max_tokens or lower the chunk size")
    max_len = cfg.model.max_model_len
    if not r.chunked_prefill and max_len is not None and bmt < max_len:
        yield ("router.batch_max_tokens", "model.max_model_len", "router.chunked_prefill"), (
            f"router.batch_max_tokens={bmt} < model.max_model_len={max_len} with router.chunked_prefill="
            f"false: a whole prompt must fit one step; set router.batch_max_tokens>={max_len}, leave it "
            f"unset, or enable router.chunked_prefill")


@rule(needs=("model.max_model_len",))
def kv_budget(cfg):
    c, max_len = cfg.cache, cfg.model.max_model_len
    if c.max_total_tokens is not None and c.max_total_tokens < max_len:
        yield ("cache.max_total_tokens", "model.max_model_len"), (
            f"cache.max_total_tokens={c.max_total_tokens} < model.max_model_len={max_len}: one request of "
            f"full length would never fit; raise cache.max_total_tokens or lower model.max_model_len")
    if c.max_total_tokens is None and c.cpu_kv_gib <= 0:
        yield ("cache.cpu_kv_gib",), f"cache.cpu_kv_gib={c.cpu_kv_gib} must be > 0 (or set cache.max_total_tokens)"


@rule()
def max_running_requests_positive(cfg):
    if cfg.router.max_running_requests < 1:
        yield ("router.max_running_requests",), (
            f"router.max_running_requests={cfg.router.max_running_requests} must be >= 1")
    if cfg.router.max_wait_tokens < 0:
        yield ("router.max_wait_tokens",), f"router.max_wait_tokens={cfg.router.max_wait_tokens} must be >= 0"


@rule()
def device_threads_nonnegative(cfg):
    if cfg.device_threads < 0:
        yield ("device_threads",), (f"device_threads={cfg.device_threads} must be >= 0 (0: from the CPUs the "
                                    "process may use)")


@rule()
def prefill_graph_tokens_nonnegative(cfg):
    if cfg.model.prefill_graph_tokens < 0:
        yield ("model.prefill_graph_tokens",), (
            f"model.prefill_graph_tokens={cfg.model.prefill_graph_tokens} must be >= 0 (0: prefill without CUDA graphs)")


@rule()
def mixed_graph_tokens_nonnegative(cfg):
    n = cfg.model.mixed_graph_tokens
    if n is not None and n < 0:
        yield ("model.mixed_graph_tokens",), (
            f"model.mixed_graph_tokens={n} must be >= 0 (0: mixed steps without CUDA graphs; null: "
            "router.batch_max_tokens up to 4096)")


@rule()
def kernel_settings_valid(cfg):
    for key, message in cfg.kernels.problems():
        yield (key,), message + " (see `llaunch --cfg job` for the kernels group's keys)"


@rule(needs=("model.family",))
def row_invariant_covers_model(cfg):
    """kernels.row_invariant's promise (a row summed alike whatever the step's other rows) holds only where every
    product of a row runs the kernels it switches: 16-bit dense layers on one rank."""
    if not cfg.kernels.row_invariant or not _serves(cfg):
        return
    m = cfg.model
    ckpt = read_checkpoint(m.path) if m.path and m.load_format != LoadFormat.dummy else None
    ckpt_quant = ckpt.weight_quant if ckpt is not None and ckpt.weight_quant and ckpt.weight_quant.served else None
    outside = [(keys, why) for keys, why in (
        # (int8 rows: each row of an invariant step on their one-row code, as the 16-bit GEMV's)
        (("model.quantization",), m.quantization == WeightQuantization.fp8 and "model.quantization=fp8: e4m3 "
         "layers take other kernels at one row (the fp8 GEMVs) than at several"),
        (("model.path",), ckpt_quant is not None and f"model.path={m.path} holds {ckpt_quant.method} weights: e4m3 "
         "layers take other kernels at one row (the fp8 GEMVs) than at several"),
        (("model.family",), m.family in MOE_FAMILIES and f"model.family={m.family}: the experts' launches and "
         "their summation order depend on the step's tokens (kernels/moe_launches.py)"),
        (("parallel.tp",), cfg.parallel.tp > 1 and f"parallel.tp={cfg.parallel.tp}: the all-reduce's summation "
         "order across ranks depends on the step's size"),
        (("model.dtype",), m.dtype == DType.float32 and "model.dtype=float32: its one-row code for a small step's "
         "rows is the 16-bit layers' GEMV (a float32 step of several rows takes cuBLAS)"),
        (("spec.num_tokens",), cfg.spec.method != SpecMethod.none and cfg.spec.num_tokens + 1 > INVARIANT_ROWS
         and f"spec.num_tokens={cfg.spec.num_tokens}: one stream's verify step holds {cfg.spec.num_tokens + 1} "
         f"tokens, past the {INVARIANT_ROWS} of a step whose rows it keeps alike (at most "
         f"{INVARIANT_ROWS - 1} proposed tokens)")) if why]
    for keys, why in outside:
        yield ("kernels.row_invariant", *keys), (
            f"kernels.row_invariant=true cannot keep a row's sums alike across steps here: {why}. Unset "
            "kernels.row_invariant (speculative decoding then may part from the spec-off text in bfloat16)")


@rule()
def timeouts_positive(cfg):
    for key in ("server.ready_timeout_s", "server.drain_timeout_s", "server.request_timeout_s",
                "router.stall_timeout_s", "bench.ready_timeout_s", "bench.timeout_s"):
        if key.startswith("bench.") and cfg.bench is None or get(cfg, key) is None:
            continue
        if not get(cfg, key) >= 0:
            yield (key,), f"{key}={get(cfg, key)} must be >= 0 (seconds)"
    if not cfg.server.max_constraint_compile_s > 0:
        yield ("server.max_constraint_compile_s",), (
            f"server.max_constraint_compile_s={cfg.server.max_constraint_compile_s} must be > 0 (seconds): no "
            "structured output would compile")


@rule()
def request_limits_positive(cfg):
    for key in ("server.max_prompts_per_request", "server.max_choices_per_request", "server.max_stop_strings",
                "server.max_stop_string_chars", "router.max_waiting_requests"):
        if get(cfg, key) < 1:
            yield (key,), f"{key}={get(cfg, key)} must be >= 1"
    if cfg.server.max_body_bytes < 1024:
        yield ("server.max_body_bytes",), (f"server.max_body_bytes={cfg.server.max_body_bytes} is under 1 KiB: "
                                           "no request would fit")


_SAMPLING_RANGES = {"temperature": (0.0, 100.0), "top_p": (1e-9, 1.0), "top_k": (-1, 1 << 30), "min_p": (0.0, 1.0),
                    "repetition_penalty": (1e-9, 100.0)}


@rule()
def sampling_defaults_valid(cfg):
    for name, value in cfg.model.sampling_defaults.items():
        low, high = _SAMPLING_RANGES.get(name, (None, None))
        if low is None or not isinstance(value, (int, float)) or not low <= value <= high:
            yield ("model.sampling_defaults",), (
                f"model.sampling_defaults.{name}={value!r}: the keys are {', '.join(_SAMPLING_RANGES)}, each within "
                f"its range ({', '.join(f'{k} [{lo}, {hi}]' for k, (lo, hi) in _SAMPLING_RANGES.items())})")


@rule()
def bench_settings_valid(cfg):
    b = cfg.bench
    if b is not None and not 1 <= b.client_procs <= max(b.concurrency, 1):
        yield ("bench.client_procs", "bench.concurrency"), (
            f"bench.client_procs={b.client_procs} must be in [1, bench.concurrency={b.concurrency}]: each client "
            "process keeps at least one request in flight")
    if b is not None and b.repeats < 1:
        yield ("bench.repeats",), f"bench.repeats={b.repeats} must be >= 1"
    for key in ("bench.slo_ttft_ms", "bench.slo_tpot_ms"):
        if b is not None and get(cfg, key) is not None and get(cfg, key) <= 0:
            yield (key,), f"{key}={get(cfg, key)} must be > 0 (or null: no such objective)"
    yield from _bench_workload_valid(b)


def _bench_workload_valid(b):
    """A trace or ShareGPT lengths (scripts/bench_trace.py) and the SLO percentile."""
    if b is None:
        return
    if b.slo_percentile is not None and not 0 < b.slo_percentile <= 100:
        yield ("bench.slo_percentile",), f"bench.slo_percentile={b.slo_percentile} must be in (0, 100]"
    if b.trace is not None and not os.path.isfile(os.path.expanduser(b.trace)):
        yield ("bench.trace",), f"bench.trace={b.trace}: no such file (a JSONL trace, scripts/bench_trace.py)"
    if (b.trace is not None or b.lengths.value != "fixed") and (b.multi_turn > 1 or b.shared_prefix_groups):
        yield ("bench.trace", "bench.lengths", "bench.multi_turn", "bench.shared_prefix_groups"), (
            "a trace or bench.lengths=sharegpt is a single-turn workload: leave bench.multi_turn=1 and "
            "bench.shared_prefix_groups=0")


@rule()
def api_key_source(cfg):
    s = cfg.server
    if s.api_key and s.api_key_file:
        yield ("server.api_key", "server.api_key_file"), (
            "server.api_key and server.api_key_file are both set: give one (the key file keeps the secret out "
            "of `ps` and the shell history)")
    elif s.api_key_file:
        try:
            empty = not secrets.read_key_file(s.api_key_file)
        except OSError as e:
            yield ("server.api_key_file",), f"server.api_key_file={s.api_key_file} cannot be read: {e.strerror}"
            return
        if empty:
            yield ("server.api_key_file",), f"server.api_key_file={s.api_key_file} is empty: its first line is the key"


@rule()
def http_workers_positive(cfg):
    if cfg.server.http_workers < 1:
        yield ("server.http_workers",), f"server.http_workers={cfg.server.http_workers} must be >= 1"


# ---- parallel layout -----------------------------------------------------------------------------


@rule()
def parallel_sizes(cfg):
    p = cfg.parallel
    for key in ("tp", "dp", "nnodes"):
        if getattr(p, key) < 1:
            yield (f"parallel.{key}",), f"parallel.{key}={getattr(p, key)} must be >= 1"
    if not 0 <= p.node_rank < max(p.nnodes, 1):
        yield ("parallel.node_rank", "parallel.nnodes"), (
            f"parallel.node_rank={p.node_rank} must be in 0..parallel.nnodes-1 (nnodes={p.nnodes})")
    if p.tp >= 1 and p.dp >= 1 and p.nnodes >= 1 and (p.tp * p.dp) % p.nnodes:
        yield ("parallel.tp", "parallel.dp", "parallel.nnodes"), (
            f"parallel.tp={p.tp} x parallel.dp={p.dp} = {p.tp * p.dp} GPUs do not split evenly over "
            f"parallel.nnodes={p.nnodes} nodes; every node must run the same number of workers")


@rule()
def multinode_addresses(cfg):
    p = cfg.parallel
    if p.nnodes > 1 and p.master_port is None:
        yield ("parallel.master_port", "parallel.nnodes"), (
            f"parallel.nnodes={p.nnodes} needs parallel.master_port: every node derives its ports from it")
    if p.nnodes > 1 and len(p.node_addrs) != p.nnodes:
        yield ("parallel.node_addrs", "parallel.nnodes"), (
            f"parallel.nnodes={p.nnodes} needs parallel.node_addrs with one address per node (node 0 "
            f"first), got {list(p.node_addrs)}")


@rule(needs=("model.num_attention_heads", "model.num_key_value_heads"))
def tp_splits_heads(cfg):
    tp, heads, kv = cfg.parallel.tp, cfg.model.num_attention_heads, cfg.model.num_key_value_heads
    if not _serves(cfg) or tp < 1 or heads % kv:
        return
    layout = HeadLayout.of(heads, kv, tp)
    if layout.padded and not cfg.parallel.pad_heads:
        extra = layout.padded_heads - heads
        yield ("parallel.tp", "model.num_attention_heads", "model.num_key_value_heads"), (
            f"model.num_attention_heads={heads} with model.num_key_value_heads={kv} do not split over "
            f"parallel.tp={tp} ranks; use a parallel.tp of {_valid_tp(heads, kv, tp)}, or set parallel.pad_heads=true to add {extra} "
            f"zero heads ({100 * extra / heads:.0f}% more attention work, same output)")


def _valid_tp(heads: int, kv: int, below: int) -> str:
    """tp values that split the attention heads and pair with the KV heads (one divides the other)."""
    ok = [d for d in range(1, min(heads, max(below, 8)) + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
    return ", ".join(map(str, ok))


@rule(live="skip")
def gpus_available(cfg):
    p = cfg.parallel
    if cfg.device != Device.cuda or not _serves(cfg) or min(p.tp, p.dp, p.nnodes) < 1:
        return
    need, have = p.tp * p.dp // p.nnodes, gpus.visible_count()
    if need > have:
        yield ("parallel.tp", "parallel.dp", "device"), (
            f"parallel.tp={p.tp} x parallel.dp={p.dp} needs {need} GPUs on this node, {have} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower tp/dp or "
            f"use device=cpu")


# ---- ports and modes -----------------------------------------------------------------------------


def _bound_ports(cfg) -> dict[str, list[int]]:
    """Fixed ports this instance binds on its host, by key (None / 0 ports are allocated later)."""
    p, m, kind = cfg.parallel, cfg.mode, cfg.mode.kind
    serves_http = kind != Mode.config_server  # a config server binds only mode.config_server_port
    ports = {"server.port": [cfg.server.port] if cfg.server.port and serves_http else []}
    if cfg.server.metrics_port is not None and _serves(cfg):
        ports["server.metrics_port"] = [cfg.server.metrics_port]
    if p.master_port is not None and _serves(cfg):
        ports["parallel.master_port"] = [p.master_port + d for d in range(max(p.dp, 1))]
    if kind == Mode.pd_decode and m.kv_transfer_port is not None:
        ports["mode.kv_transfer_port"] = [m.kv_transfer_port + r for r in range(max(p.tp, 1))]
    if kind == Mode.pd_master:
        ports["mode.pd_master_port"] = [m.pd_master_port]
    if kind == Mode.config_server:
        ports["mode.config_server_port"] = [m.config_server_port]
    return ports


@rule()
def ports_in_range(cfg):
    if not 0 <= cfg.server.port <= 65535:
        yield ("server.port",), f"server.port={cfg.server.port} must be in 1..65535 (0: any free port)"
    replicas = max(cfg.parallel.dp, 1)
    spans = {"parallel.master_port": replicas, "mode.kv_transfer_port": max(cfg.parallel.tp, 1),  # per replica / rank
             "mode.pd_master_port": 1, "mode.config_server_port": 1}
    for key, span in spans.items():
        base = get(cfg, key)
        if base is not None and not 1 <= base <= 65536 - span:
            yield (key,), f"{key}={base} must be in 1..{65536 - span} (ports {key} .. +{span - 1} are used)"


@rule()
def ports_distinct(cfg):
    seen: dict[int, str] = {}
    for key, ports in _bound_ports(cfg).items():
        for port in ports:
            if port in seen and seen[port] != key:
                yield (seen[port], key), f"{seen[port]} and {key} both bind port {port}; give them different ports"
            seen.setdefault(port, key)


@rule(live="skip")
def server_port_free(cfg):
    host, port = cfg.server.host, cfg.server.port
    if cfg.parallel.node_rank > 0 or cfg.mode.kind == Mode.config_server:  # only these bind server.port
        return
    if port and 0 < port <= 65535:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
            try:
                s.bind((host, port))
            except OSError as e:
                yield ("server.port", "server.host"), (
                    f"server.port={port} on server.host={host} cannot be bound ({e.strerror}); another server "
                    f"holds it: pick another server.port, or 0 for any free one")


@rule()
def pd_instance_is_one_replica(cfg):
    p, kind = cfg.parallel, cfg.mode.kind
    if kind in (Mode.pd_prefill, Mode.pd_decode) and (p.dp != 1 or p.nnodes != 1):
        yield ("mode.kind", "parallel.dp", "parallel.nnodes"), (
            f"mode.kind={kind.value} runs one replica on one node per instance (parallel.dp=1, "
            f"parallel.nnodes=1; got dp={p.dp}, nnodes={p.nnodes}): start more instances instead")


@rule()
def prompt_logprobs_not_in_pd(cfg):
    kind = cfg.mode.kind
    if cfg.server.return_all_prompt_logprobs and kind in (Mode.pd_prefill, Mode.pd_decode, Mode.pd_master):
        yield ("server.return_all_prompt_logprobs", "mode.kind"), (
            f"server.return_all_prompt_logprobs=true with mode.kind={kind.value}: prompt logprobs need the whole "
            "prompt's logits on one instance, which prefill/decode disaggregation splits; use mode.kind=normal "
            "or server.return_all_prompt_logprobs=false")


@rule()
def pd_addresses(cfg):
    m = cfg.mode
    if m.kind in (Mode.pd_prefill, Mode.pd_decode, Mode.pd_master) and not m.pd_master_host:
        yield ("mode.pd_master_host",), (f"mode.kind={m.kind.value} needs mode.pd_master_host (where the "
                                         "pd_master listens), e.g. mode.pd_master_host=127.0.0.1")
    if m.kind == Mode.config_server and not m.config_server_host:
        yield ("mode.config_server_host",), ("mode.kind=config_server needs mode.config_server_host (the "
                                             "address it serves on), e.g. mode.config_server_host=127.0.0.1")


@rule()
def diverse_mode_needs_prompt_cache(cfg):
    if cfg.router.diverse_mode and not cfg.cache.prompt_cache:
        yield ("router.diverse_mode", "cache.prompt_cache"), (
            "router.diverse_mode=true shares a prompt's KV between its samples through the prompt cache, but "
            "cache.prompt_cache=false: set cache.prompt_cache=true, or router.diverse_mode=false")


@rule()
def host_kv_tier_supported(cfg):
    c = cfg.cache
    if c.cpu_tokens < 0:
        yield ("cache.cpu_tokens",), f"cache.cpu_tokens={c.cpu_tokens}: give token slots >= 0 (0: no host KV tier)"
    if c.cpu_tokens > 0 and not c.prompt_cache:
        yield ("cache.cpu_tokens", "cache.prompt_cache"), (
            f"cache.cpu_tokens={c.cpu_tokens} keeps the prompt cache's evicted KV in host memory, but "
            "cache.prompt_cache=false: set cache.prompt_cache=true, or cache.cpu_tokens=0")
    if c.cpu_tokens > 0 and cfg.mode.kind != Mode.normal:
        yield ("cache.cpu_tokens", "mode.kind"), (
            f"cache.cpu_tokens={c.cpu_tokens} with mode.kind={cfg.mode.kind.value}: the host KV tier serves "
            "mode.kind=normal only; set cache.cpu_tokens=0")


@rule()
def dp_affinity_slack_valid(cfg):
    if cfg.router.dp_affinity_slack_tokens < 0:
        yield ("router.dp_affinity_slack_tokens",), (
            f"router.dp_affinity_slack_tokens={cfg.router.dp_affinity_slack_tokens}: give tokens >= 0")


@rule()
def token_healing_without_all_prompt_logprobs(cfg):
    s = cfg.server
    if s.token_healing and s.return_all_prompt_logprobs:
        yield ("server.token_healing", "server.return_all_prompt_logprobs"), (
            "server.token_healing=true backs off every prompt's last token, so the logprobs of every prompt token "
            "that server.return_all_prompt_logprobs=true returns do not exist: turn one of them off")


@rule()
def request_features_not_in_pd(cfg):
    """Features that change how the prompt is prefilled, which the prefill instance would not do."""
    kind = cfg.mode.kind
    if kind not in (Mode.pd_prefill, Mode.pd_decode, Mode.pd_master):
        return
    for key, on, why in (("server.token_healing", cfg.server.token_healing, "backs off the prompt's last token"),
                         ("router.diverse_mode", cfg.router.diverse_mode, "shares a prompt's prefill between samples")):
        if on:
            yield (key, "mode.kind"), (
                f"{key}=true with mode.kind={kind.value}: it {why}, and the prefill instance computes the prompt "
                f"as sent; use mode.kind=normal or {key}=false")
