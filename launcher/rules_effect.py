"""A key the user set where nothing reads it is refused: `spec.num_tokens=3` with spec=none, or
`router.dp_prefill_balance=true` on one replica, would otherwise be accepted and silently ignored.

READ_WHERE holds, for every key of `llaunch --help`, the contexts in which the running graph reads it
(all of them must hold); an empty tuple means it is read in every context, or that another rule
refuses it where it is not (noted beside it). Which keys the user set, as opposed to the profiles:
launcher/config_changes.py. tests/unit/test_rules_effect.py checks that every key has an entry and
that each context is read on one side and refused on the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from llaunch.launcher import config_keys
from llaunch.launcher.rule_registry import get, rule
from llaunch.launcher.rules_model import serves
from llaunch.runtime.config import Device, LlaunchConfig, LoadFormat, Mode, ModelTask, ScoreHead, SpecMethod
from llaunch.runtime.models.memory import fp8_weights

PD_MODES = (Mode.pd_prefill, Mode.pd_decode, Mode.pd_master)


def shown(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(shown(v) for v in value) + "]"
    return str(value)


Unread = Callable[[LlaunchConfig], "tuple[tuple[str, ...], str]"]


def _values(*keys: str) -> Unread:
    """The keys whose values leave a key unread, shown as `k=v and k2=v2`."""
    return lambda cfg: (keys, " and ".join(f"{k}={shown(get(cfg, k))}" for k in keys))


def _either(test: Callable[[LlaunchConfig], bool], then: Unread, otherwise: Unread) -> Unread:
    """`then` says why when test(cfg), else `otherwise`."""
    return lambda cfg: then(cfg) if test(cfg) else otherwise(cfg)


@dataclass(frozen=True)
class Context:
    """Where a key is read: `holds(cfg)`. Elsewhere `unread(cfg)` names the settings that leave it unread."""

    name: str
    holds: Callable[[LlaunchConfig], bool]
    unread: Unread
    why: str  # why nothing reads the key there
    fix: str  # how to make it read


def _cuda(cfg) -> bool:
    return cfg.device == Device.cuda


def _dummy_weights(cfg) -> bool:
    """runtime/models/weights.py resolve_load_format: dummy, or auto without a checkpoint."""
    return cfg.model.load_format == LoadFormat.dummy or (cfg.model.load_format == LoadFormat.auto and not cfg.model.path)


def _named(cfg) -> bool:
    return serves(cfg) or (cfg.mode.kind == Mode.pd_master and bool(cfg.mode.config_server_host))


def _master_dialled(cfg) -> bool:
    return not (cfg.mode.kind in (Mode.pd_prefill, Mode.pd_decode) and cfg.mode.config_server_host)


def _bench(cfg, test: Callable[[Any], bool]) -> bool:
    return cfg.bench is None or test(cfg.bench)


SERVING = Context(
    "serving", serves, _values("mode.kind"),
    "a pd_master only relays requests and a config server only keeps the registry: neither runs a model, "
    "a router or workers", "set it on the serving instances (mode.kind=normal, pd_prefill or pd_decode)")
HTTP = Context(
    "http", lambda c: c.mode.kind != Mode.config_server, _values("mode.kind"),
    "a config server serves its registry at mode.config_server_host:mode.config_server_port, without an API key",
    "set it on the pd_master and the instances")
NAMED = Context(
    "named", _named, _either(lambda c: c.mode.kind == Mode.config_server, _values("mode.kind"),
                             _values("mode.kind", "mode.config_server_host")),
    "a pd_master relays each request's model as sent; it names a model only to register with a config server",
    "set it on the serving instances")
CUDA_KERNELS = Context(
    "cuda_kernels", _cuda, _values("device"),
    "the Triton kernels and their launch settings apply to CUDA tensors; on CPU every op runs its torch reference",
    "set device=cuda")
CUDA_GRAPHS_SWITCH = Context(
    "cuda_graphs_switch", _cuda, _values("device"), "CUDA graphs are captured on GPUs only", "set device=cuda")
CUDA_GRAPHS = Context(
    "cuda_graphs", lambda c: _cuda(c) and not c.model.enforce_eager,
    _either(lambda c: not _cuda(c), _values("device"), _values("model.enforce_eager")),
    "it bounds the steps that replay CUDA graphs, which run on GPUs unless model.enforce_eager",
    "set device=cuda and model.enforce_eager=false")
CPU_WORKERS = Context(
    "cpu_workers", lambda c: c.device == Device.cpu, _values("device"),
    "it sets the CPU workers' torch threads; on a GPU the worker's host threads only launch kernels",
    "set device=cpu")
GPU_MEMORY = Context(
    "gpu_memory", _cuda, _values("device"),
    "it is the share of GPU memory llaunch may use; on CPU the KV cache gets cache.cpu_kv_gib",
    "set device=cuda (on CPU, size the KV cache with cache.cpu_kv_gib or cache.max_total_tokens)")
CPU_KV = Context(
    "cpu_kv", lambda c: c.device == Device.cpu and c.cache.max_total_tokens is None,
    _either(lambda c: c.device != Device.cpu, _values("device"), _values("cache.max_total_tokens")),
    "it is the KV budget on CPU when cache.max_total_tokens is unset",
    "use it with device=cpu and cache.max_total_tokens=null (on a GPU: cache.mem_fraction)")
DUMMY = Context(
    "dummy", _dummy_weights, _values("model.load_format", "model.path"),
    "it seeds random weights (model.load_format=dummy); a checkpoint's weights are read as they are",
    "set model.load_format=dummy")
GENERATES = Context(
    "generates", lambda c: c.model.task not in (ModelTask.score, ModelTask.embed), _values("model.task"),
    "a score or embedding model returns its head's outputs or pooled hidden states and samples no tokens",
    "serve a generating model")
FP8_WEIGHTS = Context(
    "fp8_weights", fp8_weights,
    _either(lambda c: c.model.path is None or c.model.load_format == LoadFormat.dummy, _values("model.quantization"),
            _values("model.quantization", "model.path")),
    "the decoder's linears are not e4m3 (the model's dtype, or model.quantization=int8's rows), and the LM head goes "
    "e4m3 only beside fp8 linears (model.int8_lm_head: int8 rows beside any)",
    "set model.quantization=fp8 (or serve an fp8 checkpoint)")
SCORES = Context(
    "scores", lambda c: c.model.task == ModelTask.score, _values("model.task"),
    "only a score head (a *ForSequenceClassification checkpoint) reads it", "serve a score model (model.task=score)")
YES_NO = Context(
    "yes_no", lambda c: c.model.score_head == ScoreHead.yes_no, _values("model.score_head"),
    "only a yes/no reranker's head reads two tokens' logits", "set model.score_head=yes_no")
EMBEDS = Context(
    "embeds", lambda c: c.model.task == ModelTask.embed, _values("model.task"),
    "only an embedding model pools hidden states", "serve an embedding model (model.task=embed)")
SPECULATES = Context(
    "speculates", lambda c: c.spec.method != SpecMethod.none, _values("spec.method"),
    "only speculative decoding proposes and verifies tokens", "set spec=ngram or spec=draft")
NGRAM = Context(
    "ngram", lambda c: c.spec.method == SpecMethod.ngram, _values("spec.method"),
    "only the n-gram proposer looks suffixes up", "set spec=ngram")
DRAFT = Context(
    "draft", lambda c: c.spec.method == SpecMethod.draft, _values("spec.method"),
    "only spec.method=draft loads a draft model", "set spec=draft")
IMAGES = Context(
    "images", lambda c: bool(c.model.vision),
    lambda c: (("model.vision",), f"{c.model.name or 'a model'}, which takes no images (model.vision unset)"),
    "only a vision model's requests carry images", "serve a vision model (model=qwen2-vl or qwen2.5-vl)")
CLIPS = Context(
    "clips", lambda c: bool(c.model.audio),
    lambda c: (("model.audio",), f"{c.model.name or 'a model'}, which takes no audio (model.audio unset)"),
    "only an audio model's requests carry clips", "serve an audio model (Qwen2-Audio)")
REPLICAS = Context(  # LightLLM asserts dp > 1 for enable_dp_prefill_balance
    "replicas", lambda c: c.parallel.dp > 1, _values("parallel.dp"),
    "it chooses between data-parallel replicas, and there is one", "set parallel.dp to 2 or more")
AFFINITY = Context(
    "affinity", lambda c: c.router.dp_prefix_affinity, _values("router.dp_prefix_affinity"),
    "it bounds prefix-affinity routing only", "set router.dp_prefix_affinity=true")
CHUNKED = Context(
    "chunked", lambda c: c.router.chunked_prefill, _values("router.chunked_prefill"),
    "each prompt prefills whole, in one step", "set router.chunked_prefill=true")
NOT_DECODE = Context(
    "not_decode", lambda c: c.mode.kind != Mode.pd_decode, _values("mode.kind"),
    "a decode instance's prompts are prefilled elsewhere, so it admits new requests at every step "
    "(router.max_wait_tokens=0)", "set it on normal or pd_prefill instances")
WAITS = Context(
    "waits", lambda c: c.router.max_wait_tokens > 0, _values("router.max_wait_tokens"),
    "new requests are admitted at every step already", "set router.max_wait_tokens above 0")
PD_ROLE = Context(
    "pd_role", lambda c: c.mode.kind in PD_MODES, _values("mode.kind"),
    "only prefill/decode disaggregation has a pd_master", "use it with mode=pd_master, pd_prefill or pd_decode")
MASTER_DIALLED = Context(
    "master_dialled", _master_dialled, _values("mode.config_server_host"),
    "the instance finds its masters through the config server, never at this address",
    "set mode.config_server_host=null to register with one master")
REGISTRY = Context(
    "registry", lambda c: c.mode.kind != Mode.normal, _values("mode.kind"),
    "a normal instance registers with no one", "use it with mode=pd_master, pd_prefill, pd_decode or config_server")
REGISTRY_NAMED = Context(
    "registry_named", lambda c: c.mode.config_server_host is not None, _values("mode.config_server_host"),
    "no config server is named", "set mode.config_server_host")
KV_RECEIVER = Context(
    "kv_receiver", lambda c: c.mode.kind == Mode.pd_decode, _values("mode.kind"),
    "only a decode instance receives KV; a prefill instance sends it the way each decode instance advertises",
    "set it on the pd_decode instances")
METRICS = Context(
    "metrics", lambda c: c.server.metrics_port is not None, _values("server.metrics_port"),
    "only the listener of server.metrics_port binds it", "set server.metrics_port")
RENDEZVOUS = Context(
    "rendezvous", lambda c: c.parallel.tp > 1 or c.parallel.nnodes > 1, _values("parallel.tp", "parallel.nnodes"),
    "torch.distributed joins the ranks of a replica, or the nodes; one rank on one node joins nothing",
    "use it with parallel.tp > 1 or parallel.nnodes > 1")
TENSOR_PARALLEL = Context(
    "tensor_parallel", lambda c: c.parallel.tp > 1, _values("parallel.tp"),
    "one rank holds every attention head", "use it with parallel.tp > 1")
NODES = Context(
    "nodes", lambda c: c.parallel.nnodes > 1, _values("parallel.nnodes"),
    "one node plans on its own address", "use it with parallel.nnodes > 1")
SHARED_NODE = Context(
    "shared_node", lambda c: c.parallel.tp * c.parallel.dp // max(c.parallel.nnodes, 1) >= 2,
    _values("parallel.tp", "parallel.dp", "parallel.nnodes"),
    "the /dev/shm check is for several worker ranks on one node", "use it with 2 or more ranks per node")
SHARED_PREFIX = Context(
    "shared_prefix", lambda c: _bench(c, lambda b: b.shared_prefix_groups > 0), _values("bench.shared_prefix_groups"),
    "no prompt shares a system prompt", "set bench.shared_prefix_groups above 0")
SLO = Context(
    "slo", lambda c: _bench(c, lambda b: b.slo_ttft_ms is not None or b.slo_tpot_ms is not None),
    _values("bench.slo_ttft_ms", "bench.slo_tpot_ms"),
    "there is no SLO for the requests to meet", "set bench.slo_ttft_ms or bench.slo_tpot_ms")
UNTRACED = Context(
    "untraced", lambda c: _bench(c, lambda b: b.trace is None), _values("bench.trace"),
    "the trace gives every request's arrival and lengths", "unset bench.trace")

CONTEXTS = (SERVING, HTTP, NAMED, CUDA_KERNELS, CUDA_GRAPHS_SWITCH, CUDA_GRAPHS, GPU_MEMORY, CPU_WORKERS, CPU_KV, DUMMY,
            GENERATES, FP8_WEIGHTS, SCORES, YES_NO, EMBEDS, SPECULATES, NGRAM, DRAFT, IMAGES, CLIPS, REPLICAS, AFFINITY,
            CHUNKED, NOT_DECODE, WAITS, PD_ROLE, MASTER_DIALLED, REGISTRY, REGISTRY_NAMED, KV_RECEIVER, METRICS,
            RENDEZVOUS, TENSOR_PARALLEL, NODES, SHARED_NODE, SHARED_PREFIX, SLO, UNTRACED)


def _each(contexts: tuple[Context, ...], *keys: str) -> dict[str, tuple[Context, ...]]:
    return {key: contexts for key in keys}


_ARCHITECTURE = tuple(f"model.{f}" for f in (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings",
    "attention_bias", "mrope_section", "vision", "audio", "sliding_window", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "layer_types", "hidden_act", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "rope_local_base_freq", "partial_rotary_factor"))

READ_WHERE: dict[str, tuple[Context, ...]] = {
    # read in every mode: the launcher plans, supervises and logs every graph with them
    **_each((), "device", "dry_run", "log_level", "mode.kind", "parallel.zmq_mode", "server.drain_timeout_s",
            "server.ready_timeout_s"),
    # refused by another rule where unread: tpsp_mix_not_implemented (always), host_kv_tier_supported
    # (mode.kind != normal), dp_fetch_supported, tgi_api_mode (mode.kind != normal), metrics_port_valid (no workers)
    **_each((), "parallel.tpsp_mix", "cache.cpu_tokens", "cache.dp_fetch", "server.tgi_api", "server.metrics_port"),
    # the model, its weights and its workers
    **_each((NAMED,), "model.name"),
    **_each((SERVING,), "model.family", "model.path", "model.tokenizer", "model.load_format", "model.dtype",
            "model.max_model_len", "model.task", "model.quantization", *_ARCHITECTURE),
    **_each((SERVING, DUMMY), "model.seed"),
    **_each((SERVING, CUDA_GRAPHS_SWITCH), "model.enforce_eager"),
    **_each((SERVING, CUDA_GRAPHS), "model.prefill_graph_tokens", "model.graph_max_len_in_batch",
            "model.mixed_graph_tokens"),
    **_each((SERVING, GENERATES), "model.eos_token_ids", "model.generation_config", "model.sampling_defaults"),
    **_each((SERVING, GENERATES, FP8_WEIGHTS), "model.fp8_lm_head"),
    **_each((SERVING, GENERATES), "model.int8_lm_head"),  # lm_head_one_format refuses it beside model.fp8_lm_head
    **_each((SERVING, SCORES), "model.num_labels", "model.labels", "model.score_head", "model.pad_token_id"),
    **_each((SERVING, SCORES, YES_NO), "model.score_token_ids"),
    # embed_matryoshka_consistent refuses matryoshka_dimensions with matryoshka=false
    **_each((SERVING, EMBEDS), "model.pooling", "model.normalize", "model.matryoshka", "model.matryoshka_dimensions"),
    # parallel_sizes refuses node_rank outside 0..nnodes-1; cuda_mps_needs_gpus refuses cuda_mps on CPU
    **_each((SERVING,), "parallel.tp", "parallel.dp", "parallel.nnodes", "parallel.node_rank", "parallel.cuda_mps",
            "parallel.ep"),
    **_each((SERVING, RENDEZVOUS), "parallel.master_addr", "parallel.master_port"),
    **_each((SERVING, NODES), "parallel.node_addrs"),
    **_each((SERVING, TENSOR_PARALLEL), "parallel.pad_heads"),
    **_each((SERVING, SHARED_NODE), "parallel.shm_warning"),
    # kv_scales_need_fp8 refuses the scale files without cache.kv_dtype=fp8_e4m3; fp8_kv_not_in_pd fp8 on pd nodes
    **_each((SERVING,), "cache.max_total_tokens", "cache.prompt_cache", "cache.kv_dtype", "cache.kv_scales",
            "cache.kv_calibration"),
    **_each((SERVING, GPU_MEMORY), "cache.mem_fraction"),
    **_each((SERVING, CPU_WORKERS), "device_threads"),
    **_each((SERVING, CPU_KV), "cache.cpu_kv_gib"),
    # prefill/decode disaggregation
    **_each((PD_ROLE, MASTER_DIALLED), "mode.pd_master_host", "mode.pd_master_port"),
    **_each((REGISTRY,), "mode.config_server_host"),
    **_each((REGISTRY, REGISTRY_NAMED), "mode.config_server_port"),
    **_each((KV_RECEIVER,), "mode.kv_transfer_port", "mode.kv_transport"),
    # the router (request_features_not_in_pd also refuses diverse_mode on pd nodes)
    **_each((SERVING,), "router.max_running_requests", "router.batch_max_tokens", "router.chunked_prefill",
            "router.max_waiting_requests", "router.diverse_mode", "router.stall_timeout_s", "router.on_stall",
            "router.step_trace"),
    **_each((SERVING, CHUNKED), "router.chunked_prefill_size"),
    **_each((SERVING, NOT_DECODE), "router.max_wait_tokens"),
    **_each((SERVING, NOT_DECODE, WAITS), "router.token_ratio"),
    **_each((SERVING, REPLICAS), "router.dp_prefill_balance", "router.dp_prefix_affinity"),
    **_each((SERVING, REPLICAS, AFFINITY), "router.dp_affinity_slack_tokens"),
    # the HTTP side: the pd_master binds server.host:port too, and checks the API key
    **_each((HTTP,), "server.host", "server.port", "server.api_key", "server.api_key_file"),
    **_each((SERVING,), "server.http_workers", "server.request_timeout_s", "server.max_body_bytes",
            "server.max_prompts_per_request", "server.max_choices_per_request", "server.max_stop_strings",
            "server.max_stop_string_chars", "server.max_constraint_chars", "server.max_constraint_depth",
            "server.max_constraint_compile_s",
            "server.tool_call_format", "server.token_healing", "server.return_all_prompt_logprobs",
            "server.unknown_fields", "server.trust_request_chat_template", "server.metrics_prefix",
            "server.profile_dir"),
    **_each((SERVING, METRICS), "server.metrics_host"),
    **_each((SERVING, GENERATES), "server.chat_template", "server.reasoning_parser"),
    **_each((SERVING, CUDA_KERNELS), "kernels.backend", "kernels.gemv", "kernels.gemv_shapes",
            "kernels.pdl", "kernels.pdl_kernels", "kernels.pdl_late", "kernels.moe_shapes", "kernels.fp8_gemm",
            "kernels.skinny_rows", "kernels.skinny_shapes", "kernels.skinny_one_row", "kernels.fp8_swap_ab",
            "kernels.fp8_words", "kernels.fp8_fused_mlp", "kernels.fp8_fused_norm", "kernels.fp8_norm_epilogue",
            "kernels.row_invariant"),
    # speculative decoding (spec_where_rows_decode refuses spec.method on pd nodes and score models)
    **_each((SERVING,), "spec.method"),
    **_each((SERVING, SPECULATES), "spec.num_tokens", "spec.max_batch"),
    **_each((SERVING, NGRAM), "spec.ngram_min", "spec.ngram_max", "spec.chain",
            "spec.adaptive"),
    **_each((SERVING, DRAFT), "spec.draft_model_path", "spec.draft_ahead"),
    # encoder servers: encoder_group_matches_model refuses their keys on a model without that encoder,
    # visual_tp_valid visual.tp on a model without a vision tower
    **_each((SERVING,), "visual.embed_cache_mib", "visual.dp", "visual.tp", "visual.batch_size", "visual.devices",
            "audio.embed_cache_mib", "audio.dp", "audio.batch_size", "audio.devices"),
    **_each((SERVING, IMAGES), "visual.max_images_per_request", "visual.max_image_bytes", "visual.max_image_pixels",
            "visual.allowed_local_media_path"),
    **_each((SERVING, CLIPS), "audio.max_clip_seconds", "audio.max_clip_bytes", "audio.max_clips_per_request"),
    # a benchmark job reads its bench profile whole
    **_each((), "bench.num_prompts", "bench.input_len", "bench.output_len", "bench.concurrency", "bench.warmup",
            "bench.shared_prefix_groups", "bench.multi_turn", "bench.client_procs", "bench.ready_timeout_s",
            "bench.timeout_s", "bench.repeats", "bench.slo_ttft_ms", "bench.slo_tpot_ms", "bench.trace"),
    **_each((SHARED_PREFIX,), "bench.shared_prefix_len"),
    **_each((SLO,), "bench.slo_percentile"),
    **_each((UNTRACED,), "bench.request_rate", "bench.lengths"),
}


def unread_because(cfg: LlaunchConfig, key: str, value: Any):
    """(context keys, message) when nothing reads `key` (set to `value`) in `cfg`; None when something does."""
    for ctx in READ_WHERE.get(key, ()):
        if not ctx.holds(cfg):
            keys, setting = ctx.unread(cfg)
            return keys, (f"{key}={shown(value)} has no effect with {setting}: {ctx.why}; {ctx.fix}, "
                          "or drop the key")
    return None


@rule(changes=True)
def keys_have_effect(cfg, changed):
    """`changed`: {key: the value the user gave}; the resolved cfg may hold a derived one."""
    for key in (k.name for k in config_keys.all_keys() if k.name in changed):
        found = unread_because(cfg, key, changed[key])
        if found:
            keys, message = found
            yield (key, *(k for k in keys if k != key)), message
