"""The typed configuration, the contract every process reads: one frozen dataclass per Hydra group,
plus the resolved run config.

Pure dataclasses (no Hydra, no torch) so every process and the launcher can read them: the launcher
composes with Hydra, validates with launcher/rules.py, fills derived values, and hands children a
`RunConfig` decoded from the run directory's YAML with msgspec. The `kernels` group's schema is the
kernels' own settings class (kernels/settings.py), which the worker applies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from llaunch.kernels.settings import KernelSettings


class LoadFormat(str, Enum):
    auto = "auto"
    safetensors = "safetensors"
    gguf = "gguf"
    dummy = "dummy"


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class WeightQuantization(str, Enum):
    fp8 = "fp8"  # e4m3 weights, one scale per output channel; activations quantized per token (W8A8)
    int8 = "int8"  # int8 weights, one scale per output channel; activations in the model's dtype (W8A16)


class KvDType(str, Enum):
    auto = "auto"  # the model's dtype (model.dtype)
    fp8_e4m3 = "fp8_e4m3"  # float8_e4m3fn with one scale per layer for K and one for V: half of bf16's bytes


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class BenchLengths(str, Enum):
    fixed = "fixed"  # every request bench.input_len prompt tokens and bench.output_len output tokens
    sharegpt = "sharegpt"  # ShareGPT-like (log-normal) lengths with those means (scripts/bench_trace.py)


class ToolCallFormat(str, Enum):
    hermes = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2/2.5, most chat models)
    llama3_json = "llama3_json"  # {"name": ..., "parameters": {...}} (Llama 3)


class ReasoningParser(str, Enum):
    none = "none"  # the answer's text is its content, <think> blocks and all
    qwen3 = "qwen3"  # <think>…</think> the model opens itself → reasoning_content (Qwen3, QwQ)
    deepseek_r1 = "deepseek_r1"  # the prompt opens <think>: the answer until </think> is reasoning (R1, Qwen3 thinking-only)


class MetricsPrefix(str, Enum):
    llaunch = "llaunch"  # llaunch:time_to_first_token_seconds, ...
    vllm = "vllm"  # vllm:time_to_first_token_seconds, ...: vLLM's names, which its dashboards and autoscalers read


class UnknownFields(str, Enum):
    warn = "warn"  # served without the field, which a log line and the X-Ignored-Fields header name (vLLM's way)
    reject = "reject"  # a 400 naming the field


class KvTransport(str, Enum):
    zmq = "zmq"  # pages through host memory over TCP: CPU, GPUs, across hosts
    nccl = "nccl"  # GPU to GPU through a NCCL pair group per prefill/decode rank pair (gloo on CPU)


class ZmqMode(str, Enum):
    auto = "auto"  # ipc on one node, tcp across nodes
    ipc = "ipc"  # unix sockets in a private directory under the temp dir
    tcp = "tcp"  # loopback TCP ports: hosts without a shared, writable /tmp (LightLLM's zmq_mode=tcp://)


class LogLevel(str, Enum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class OnStall(str, Enum):
    report = "report"  # /health/ready fails and the stall is counted; the server stays up
    exit = "exit"  # the router exits non-zero, so llaunch tears the graph down and a supervisor can restart it


class ModelTask(str, Enum):
    # score when config.json's architectures name a classification/reward head, embed for a sentence-transformers
    # folder (modules.json), else generate
    auto = "auto"
    generate = "generate"  # a causal LM: sample tokens
    score = "score"  # a sequence classification / reward head: prefill only, return its outputs
    embed = "embed"  # an embedding model: prefill only, return the final norm's hidden states pooled (/v1/embeddings)


class ScoreHead(str, Enum):
    linear = "linear"  # *ForSequenceClassification: `score` Linear(hidden, num_labels), no bias
    mlp = "mlp"  # Qwen2ForRewardModel (Qwen2.5-Math-RM): `score` Linear(h, h) + ReLU + Linear(h, num_labels), biased
    # a causal LM judging a (query, document) prompt (Qwen3-Reranker): one output, logit(yes) - logit(no) at the last
    # token, whose sigmoid is the softmax's P(yes) over the two
    yes_no = "yes_no"


class Pooling(str, Enum):
    last = "last"  # the last prompt token's hidden state (Qwen3-Embedding, gte-Qwen2)
    mean = "mean"  # the mean over every prompt position
    cls = "cls"  # the first prompt position's


class Mode(str, Enum):
    normal = "normal"
    pd_prefill = "pd_prefill"
    pd_decode = "pd_decode"
    pd_master = "pd_master"
    config_server = "config_server"


@dataclass(frozen=True)
class ModelConfig:
    # Served model name (the OpenAI `model` field). None: the checkpoint folder's (or .gguf file's)
    # name, as vLLM serves a path's last component; without a path, the family.
    name: Optional[str] = None
    # llama | mistral | qwen2 | qwen3 | gemma2 | gemma3_text | phi3 | qwen2_vl | ...; None: from config.json's model_type
    family: Optional[str] = None
    path: Optional[str] = None  # Hugging Face folder (config.json, *.safetensors, tokenizer) or .gguf
    tokenizer: Optional[str] = None  # defaults to path
    load_format: LoadFormat = LoadFormat.auto  # auto: from path (.gguf or safetensors); dummy: random weights
    dtype: DType = DType.auto  # auto: config.json's dtype on GPU (a float32 one: bfloat16, as vLLM), float32 on CPU
    seed: int = 0  # dummy weights
    enforce_eager: bool = False  # no CUDA graphs (vLLM's name): for debugging and A/B timing
    # Longest prompt chunk whose prefill, when it runs alone, replays a CUDA graph (buckets of 64
    # tokens): an idle server's time to first token is then the device's, not the host's launches. 0: eager.
    prefill_graph_tokens: int = 1024
    # Longest step with prefill chunks beside decode rows (or several chunks) that replays CUDA graphs
    # piecewise, its attentions launched between them (buckets of 64 tokens to 512, of 128 beyond): under
    # load the host's launches, not the device, would set those steps' time. None: router.batch_max_tokens
    # up to 4096 (larger steps run eagerly: their device time hides more of the host's); 0: eager.
    mixed_graph_tokens: Optional[int] = None
    # Longest context a decode step may hold and still replay a CUDA graph (LightLLM's
    # graph_max_len_in_batch); a step with a longer row runs eagerly. None: max_model_len.
    graph_max_len_in_batch: Optional[int] = None
    max_model_len: Optional[int] = None  # context length; default: max_position_embeddings
    eos_token_ids: Optional[List[int]] = None  # stop tokens (LightLLM's eos_id); default: config.json / generation_config.json
    # What an OpenAI request that does not set temperature, top_p, top_k, min_p or repetition_penalty
    # gets (/generate keeps LightLLM's): generation_config.json's values (as vLLM), then these on top.
    generation_config: bool = True  # false: ignore generation_config.json's sampling values
    sampling_defaults: Dict[str, float] = field(default_factory=dict)  # e.g. {temperature: 0.7, top_p: 0.8}
    # Architecture (config.json's names). None: read from `path`/config.json; sized profiles set them so
    # dummy weights need no files.
    hidden_size: Optional[int] = None  # architecture: width of the residual stream
    intermediate_size: Optional[int] = None  # architecture: MLP width
    num_hidden_layers: Optional[int] = None  # architecture: decoder layers
    num_attention_heads: Optional[int] = None  # architecture: query heads
    num_key_value_heads: Optional[int] = None  # architecture: KV heads (GQA)
    head_dim: Optional[int] = None  # architecture: None: hidden_size / num_attention_heads
    vocab_size: Optional[int] = None  # architecture: embedding rows (may exceed the tokenizer's)
    max_position_embeddings: Optional[int] = None  # architecture: the trained context
    rope_theta: Optional[float] = None  # architecture: rotary base
    # architecture: rope_scaling / rope_parameters (linear, dynamic, yarn, longrope, llama3; null: plain RoPE)
    rope_scaling: Optional[Dict[str, Any]] = None
    rms_norm_eps: Optional[float] = None  # architecture: RMSNorm epsilon
    tie_word_embeddings: Optional[bool] = None  # architecture: the LM head shares the embedding
    attention_bias: Optional[bool] = None  # q/k/v bias (Qwen2)
    # LightLLM's use_reward_model: score serves a *ForSequenceClassification checkpoint's head (/classify,
    # /v1/score, /get_score, /v1/rerank) instead of generating; embed an embedding model's pooled hidden states
    # (/v1/embeddings). auto: score when config.json's architectures name a classification head (or
    # score_head=yes_no), embed for a sentence-transformers folder (modules.json)
    task: ModelTask = ModelTask.auto
    num_labels: Optional[int] = None  # architecture: outputs of the score head (task=score); from config.json
    labels: Optional[List[str]] = None  # task=score: names of the head's outputs; default config.json's id2label
    score_head: Optional[ScoreHead] = None  # task=score: the head's form; None: from config.json's architectures
    pad_token_id: Optional[int] = None  # task=score: trailing pad tokens are not pooled (transformers); config.json's
    # score_head=yes_no: the ids of the [yes, no] tokens whose logits decide; None: the vocabulary's "yes" and "no"
    score_token_ids: Optional[List[int]] = None
    # task=embed: how a prompt's final-norm hidden states become one vector; None: the checkpoint's
    # 1_Pooling/config.json (sentence-transformers), else last
    pooling: Optional[Pooling] = None
    # task=embed: L2-normalize the vector; None: modules.json has a Normalize module (no modules.json: normalized)
    normalize: Optional[bool] = None
    # task=embed: a request's `dimensions` is served (Matryoshka-trained: the first d values are an embedding);
    # None: config.json's is_matryoshka / matryoshka_dimensions
    matryoshka: Optional[bool] = None
    # task=embed with matryoshka: the sizes a request may ask for; None: config.json's, else any up to hidden_size
    matryoshka_dimensions: Optional[List[int]] = None
    mrope_section: Optional[List[int]] = None  # architecture: Qwen2-VL's M-RoPE runs of rotary frequencies (t, h, w)
    # architecture: the attention window (tokens) of sliding-window layers: every layer of Mistral and Phi-3, Gemma's
    # local ones (a query sees its last sliding_window positions; the whole KV is kept)
    sliding_window: Optional[int] = None
    # architecture: each layer's attention, sliding_attention | full_attention (Gemma 2/3 interleave them); None: every
    # layer windowed when sliding_window is set (Gemma: its family's pattern, 1 in 2 / 5 in 6 local)
    layer_types: Optional[List[str]] = None
    # architecture: the MLP's activation, silu | gelu_pytorch_tanh (Gemma's GeGLU); None: silu
    hidden_act: Optional[str] = None
    # architecture: Gemma's attention scale, query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    query_pre_attn_scalar: Optional[float] = None
    # architecture: Gemma 2's attention logit soft-capping, cap · tanh(score / cap); None: none
    attn_logit_softcapping: Optional[float] = None
    # architecture: Gemma 2's final logit soft-capping, cap · tanh(logit / cap); None: none
    final_logit_softcapping: Optional[float] = None
    # architecture: Gemma 3's sliding layers' rotary base (plain RoPE; rope_theta and rope_scaling are the global
    # layers'); None: one rotary table for every layer
    rope_local_base_freq: Optional[float] = None
    # architecture: rotary on the first head_dim x factor dims of each head (Phi-3 family: Phi-4-mini's 0.75); None: 1
    partial_rotary_factor: Optional[float] = None
    vision: Optional[Dict[str, Any]] = None  # architecture: Qwen2-VL's vision tower and image token ids (config.json)
    audio: Optional[Dict[str, Any]] = None  # architecture: Qwen2-Audio's audio encoder and audio token id (config.json)
    # architecture, mixture of experts (qwen2_moe, qwen3_moe, mixtral; unset: a dense model): routed experts of an
    # MoE layer (config.json's num_experts / num_local_experts)
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None  # architecture: top-k, the experts each token goes through
    moe_intermediate_size: Optional[int] = None  # architecture: one expert's MLP width (Mixtral's intermediate_size)
    norm_topk_prob: Optional[bool] = None  # architecture: the k routing weights renormalized to sum to 1 (Mixtral: yes)
    # architecture: Qwen2-MoE's shared expert's MLP width (every token goes through it, gated); 0: none
    shared_expert_intermediate_size: Optional[int] = None
    # architecture: layer i is an MoE layer when (i + 1) % decoder_sparse_step == 0 and it is not in mlp_only_layers
    decoder_sparse_step: Optional[int] = None
    mlp_only_layers: Optional[List[int]] = None  # architecture: layers with a dense MLP (intermediate_size) among MoE
    # fp8: quantize a bf16/fp32 checkpoint's decoder linear weights to e4m3 at load (as vLLM's --quantization
    # fp8); int8: to int8 rows, weight-only (SmolLM2's top-1 94.8% against bf16's 96.8%, e4m3's 88.5%). None: as the
    # checkpoint is (an fp8 checkpoint's quantization_config is always honoured; either value beside one exits 2).
    quantization: Optional[WeightQuantization] = None  # fp8 | int8 | None
    # fp8 weights (model.quantization=fp8 or an fp8 checkpoint): the LM head in e4m3 too, a scale per vocabulary row
    # (a tied embedding keeps its 16-bit copy for the lookup); off: the head stays in the model's dtype, as vLLM's
    fp8_lm_head: bool = False
    # the LM head's weights in int8, a scale per vocabulary row, its inputs in the model's dtype (weight-only, any
    # weights; kernels/int8_rows.py): half a 16-bit head's bytes a decode step for ~0.6 point of SmolLM2's top-1
    # agreement where e4m3 costs 7.8 (a tied embedding keeps its 16-bit copy for the lookup)
    int8_lm_head: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor parallel ranks per replica (one GPU each)
    dp: int = 1  # data parallel replicas, each with its own router
    nnodes: int = 1  # hosts the graph spans
    node_rank: int = 0  # this host's index (0 runs the HTTP front)
    master_addr: str = "127.0.0.1"  # rendezvous for torch.distributed (node 0's address)
    master_port: Optional[int] = None  # None: allocated
    node_addrs: List[str] = field(default_factory=list)  # nnodes > 1: every node's address, node 0 first
    pad_heads: bool = False  # allow zero heads when attention heads do not split over tp (exact, more work)
    # Expert parallelism of MoE models: 1 splits every expert's intermediate columns over the tp ranks; parallel.tp
    # gives each rank whole experts (num_experts / tp; vLLM's enable_expert_parallel). Either way a rank computes
    # its share for every token of the step and one all-reduce sums the shares.
    ep: int = 1
    zmq_mode: ZmqMode = ZmqMode.auto  # transport between the graph's processes: auto, ipc, tcp (LightLLM's zmq_mode)
    # Run the graph's GPU processes under a CUDA MPS daemon that llaunch starts and stops (LightLLM's enable_mps).
    cuda_mps: bool = False
    # Sequence-parallel norms inside tensor parallelism (LightLLM's enable_tpsp_mix_mode): not implemented, refused.
    tpsp_mix: bool = False
    # Warn at start when /dev/shm is too small for the collectives of several ranks on this node
    # (false: LightLLM's disable_shm_warning).
    shm_warning: bool = True


@dataclass(frozen=True)
class CacheConfig:
    mem_fraction: float = 0.9  # share of GPU memory llaunch may use (weights + activations + KV)
    max_total_tokens: Optional[int] = None  # KV slots; None: sized from memory
    cpu_kv_gib: float = 1.0  # KV budget on CPU when max_total_tokens is unset
    prompt_cache: bool = True  # reuse the KV of shared prompt prefixes (a radix tree of finished requests)
    cpu_tokens: int = 0  # host-memory KV tier under the prompt cache, token slots per replica (evicted KV is kept there); 0: off
    dp_fetch: bool = False  # parallel.dp > 1 with cpu_tokens: a replica missing a prefix copies it from another replica's host tier instead of computing it
    kv_dtype: KvDType = KvDType.auto  # auto: the model's dtype; fp8_e4m3: 1 byte per element (2x the tokens of bf16)
    # fp8_e4m3: a JSON file of per-layer scales {"k_scale": [...], "v_scale": [...]} (written by kv_calibration);
    # None: every scale 1.0 (K and V values beyond ±448 saturate).
    kv_scales: Optional[str] = None
    # A JSON file the workers keep writing (every 2 s while it changes): per-layer K/V absmax / 448 over every
    # token they served (load it with kv_scales). Serve a calibration set with it set, then stop the server.
    kv_calibration: Optional[str] = None


@dataclass(frozen=True)
class VisualConfig:
    """Images of multimodal models (Qwen2-VL): what a request may send, and the visual servers (audio models: audio.*)."""

    max_images_per_request: int = 8  # image_url parts per chat request; more: 400
    max_image_bytes: int = 20 * 2**20  # encoded bytes of one image (after base64 decoding); more: 400
    max_image_pixels: int = 4096 * 4096  # width x height of one decoded image; more: 400
    # image_url file:// URLs (and plain paths) are read only under this folder; None: refused (400).
    allowed_local_media_path: Optional[str] = None
    # Embeddings of recent images, keyed by a hash of their pixels (LRU): a repeated image is not encoded again.
    embed_cache_mib: int = 512
    dp: int = 1  # visual server processes (each with its own embed cache; an image goes to the one its hash picks)
    tp: int = 1  # processes (GPUs) of one visual server splitting its vision tower (heads, MLP) with all-reduces
    batch_size: int = 8  # images a visual server encodes in one forward pass
    devices: Optional[List[int]] = None  # GPU of each visual process (visual.dp × visual.tp, server-major); None: GPU (v·tp + r) % node GPUs


@dataclass(frozen=True)
class AudioConfig:
    """Audio clips of Qwen2-Audio: what a request may send, and its audio servers (runtime/encoder_servers.py)."""

    max_clip_seconds: float = 30.0  # one clip's duration after decoding; longer: 400 (the encoder reads 30 s)
    max_clip_bytes: int = 10 * 2**20  # encoded bytes of one clip (after base64 decoding); more: 400
    max_clips_per_request: int = 4  # input_audio / audio_url parts per chat request; more: 400
    embed_cache_mib: int = 512  # each audio server's embed cache (LRU of clip embeddings by sample hash, shared memory)
    dp: int = 1  # audio server processes (each with its own embed cache; a clip goes to the one its hash picks)
    batch_size: int = 8  # clips an audio server encodes in one forward pass
    devices: Optional[List[int]] = None  # GPU of each audio process (audio.dp of them); None: GPU a % node GPUs


@dataclass(frozen=True)
class ModeConfig:
    kind: Mode = Mode.normal  # normal, or a role in prefill/decode disaggregation
    pd_master_host: str = "127.0.0.1"  # pd_prefill / pd_decode: where the PD master listens
    pd_master_port: int = 60011  # the PD master's port
    config_server_host: Optional[str] = None  # several PD masters: the config server they register with
    config_server_port: int = 60088  # the config server's port
    kv_transfer_port: Optional[int] = None  # pd_decode: first rank's port (rank r: +r); None: allocated
    kv_transport: KvTransport = KvTransport.zmq  # pd_decode: how prefill instances send it KV


@dataclass(frozen=True)
class RouterConfig:
    max_running_requests: int = 1000  # requests in the running batch at once, per replica
    batch_max_tokens: Optional[int] = None  # tokens per forward step; None: derived
    chunked_prefill: bool = True  # long prompts prefill in chunks that share steps with decodes
    chunked_prefill_size: int = 1024  # tokens of one prompt per step
    max_wait_tokens: int = 0  # decode steps to run before new prefills join the batch
    # dp > 1: send each request to the replica with the fewest prompt tokens still to prefill (then the
    # least load), so prefills spread evenly over replicas (LightLLM's enable_dp_prefill_balance).
    dp_prefill_balance: bool = False
    dp_prefix_affinity: bool = False  # dp > 1: a prompt goes to the replica its longest known prefix went to (its cached KV), within dp_affinity_slack_tokens of the least load
    dp_affinity_slack_tokens: int = 32768  # dp_prefix_affinity: how many outstanding tokens more than the least loaded replica the prefix's replica may have
    token_ratio: float = 0.0  # KV usage below which new requests are admitted without waiting
    # Requests waiting for admission, per replica: beyond it a new request is refused at once (HTTP 503
    # with Retry-After) instead of queueing for minutes behind the others.
    max_waiting_requests: int = 1024
    # LightLLM's diverse_mode: samples of one prompt (n, best_of) prefill it once. A request whose prompt
    # another running request is still prefilling waits until that prompt's KV is computed, then
    # borrows it from the prompt cache and computes only its last token. Needs cache.prompt_cache;
    # samples stay apart by their seeds (the request's seed + i, or one drawn each).
    diverse_mode: bool = False
    # A step not back after this long means the engine is stalled (a worker hung in a kernel, a
    # remote node gone): /health/ready fails and `on_stall` decides what else happens.
    stall_timeout_s: float = 300.0
    on_stall: OnStall = OnStall.report  # report: /health/ready fails; exit: the launcher exits 4
    # A JSONL file that gets one line per step (plan, timings; runtime/router/step_trace.py), for finding
    # where a workload's time goes; dp replica N > 0 writes PATH.N. None: no trace, no timing events.
    step_trace: Optional[str] = None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the HTTP API's interface (0.0.0.0: every interface)
    port: int = 8000  # the HTTP API's port; 0: any free port
    http_workers: int = 1  # frontend processes sharing the port
    # Bearer key every API request must carry. Given on the command line it shows in `ps`: prefer
    # $LLAUNCH_API_KEY (conf/server/default.yaml reads it) or api_key_file. Never written to the run dir.
    api_key: Optional[str] = None
    api_key_file: Optional[str] = None  # a file holding the key (first line)
    drain_timeout_s: float = 60.0  # SIGTERM: how long in-flight requests may take to finish
    request_timeout_s: Optional[float] = None  # a request running longer is aborted (504, or an error event)
    # Limits on one request; beyond them a 400 names the field.
    max_body_bytes: int = 16 * 2**20
    max_prompts_per_request: int = 256  # /v1/completions with a list of prompts
    max_choices_per_request: int = 256  # prompts × n: the engine requests one HTTP request may start
    max_stop_strings: int = 32  # stop strings (and stop token ids, bad words) per request
    max_stop_string_chars: int = 512  # characters of one stop string
    # A structured output's spec (schema, regex, grammar, choices, tools) compiles in the frontend: these
    # bound its size and a JSON schema's nesting, so no request holds the compiler for seconds.
    max_constraint_chars: int = 131072  # characters of the spec, as compiled (a choice list's grammar, a schema's JSON)
    max_constraint_depth: int = 64  # nesting of a JSON schema's objects and arrays
    # Seconds a spec may compile (in the frontend's compile processes, apart from request parsing); a
    # longer compile is ended and its request gets a 400 naming the field (size does not bound compile
    # time: a 1,800-character regex took 11 s)
    max_constraint_compile_s: float = 30.0
    ready_timeout_s: float = 900.0  # launch: how long the graph may take until every process is ready
    # How the model writes tool calls (OpenAI `tools`); None: the one its chat template speaks.
    tool_call_format: Optional[ToolCallFormat] = None
    # Token healing (LightLLM's token_healing_mode) on /v1/completions and /generate: the prompt's last
    # token is backed off and the first output token must start with its text, so a prompt ending
    # mid-word continues the word as the tokenizer would cut it; a request's `token_healing` overrides
    # it. Chat prompts end with the template's assistant header: never healed.
    token_healing: bool = False
    return_all_prompt_logprobs: bool = False  # /generate returns every prompt token's logprob (LightLLM's flag)
    # POST /generate, /generate_stream (and /) speak text-generation-inference's shapes instead of
    # LightLLM's, and GET /info answers TGI's info (LightLLM's use_tgi_api).
    tgi_api: bool = False
    metrics_port: Optional[int] = None  # /metrics also on this port, without the API key (LightLLM's metric_port); None: API port only
    metrics_host: str = "127.0.0.1"  # the interface of metrics_port's listener (0.0.0.0: every interface)
    # /metrics series are named `<prefix>:...`; vllm: vLLM's names for the series vLLM has (its Grafana
    # dashboards work unchanged), and llaunch's own series under the same prefix
    metrics_prefix: MetricsPrefix = MetricsPrefix.llaunch
    # A request field that no API llaunch speaks (OpenAI, vLLM, TGI, LightLLM) defines: warn (served
    # without it; named in a log line and the X-Ignored-Fields response header) | reject (a 400 naming it).
    unknown_fields: UnknownFields = UnknownFields.warn
    # A chat request's own `chat_template` (Jinja) is rendered (vLLM's --trust-request-chat-template);
    # false: such a request is refused with a 400 (a template is code: loops can hold a frontend thread).
    trust_request_chat_template: bool = False
    # A Jinja chat template file that replaces the tokenizer's (vLLM's --chat-template); None: the tokenizer's
    chat_template: Optional[str] = None
    # Chat answers' <think> blocks come back as message.reasoning_content / delta.reasoning_content, apart from
    # content (vLLM's --reasoning-parser); a request's include_reasoning=false drops them.
    reasoning_parser: ReasoningParser = ReasoningParser.none
    # POST /start_profile and /stop_profile (vLLM's and SGLang's routes) run torch.profiler in every worker and
    # write each rank's trace and kernel table into this directory; None: those routes answer 400
    profile_dir: Optional[str] = None


@dataclass(frozen=True)
class BenchConfig:
    num_prompts: int = 5  # requests the benchmark sends
    input_len: int = 512  # prompt tokens each
    output_len: int = 256  # tokens generated each (ignore_eos)
    concurrency: int = 1  # requests in flight at once
    request_rate: float = float("inf")  # arrivals per second (Poisson); inf: all at once, capped by concurrency
    warmup: int = 1  # requests sent first and not counted
    shared_prefix_groups: int = 0  # > 0: prompts share one of this many system prompts (prompt cache)
    shared_prefix_len: int = 0  # tokens of each shared system prompt
    multi_turn: int = 1  # turns per conversation, each re-sending the history
    client_procs: int = 1  # benchmark client processes (one Python process cannot keep c256 busy)
    ready_timeout_s: float = 900.0  # the job's server: launch until /health answers
    timeout_s: float = 3600.0  # the benchmark client's whole run, per repeat
    # Runs on one server, each on prompts no earlier run sent (its own seed): the report's figure is
    # the slowest run's output tok/s, with the spread of every figure.
    repeats: int = 1
    slo_ttft_ms: Optional[float] = None  # goodput: requests per second that start within this...
    slo_tpot_ms: Optional[float] = None  # ...and keep each token within this (either alone works)
    slo_percentile: Optional[float] = None  # a run where under this % of requests meet the SLOs has goodput 0
    trace: Optional[str] = None  # JSONL trace replayed: arrival_s, input_len, output_len per request
    lengths: BenchLengths = BenchLengths.fixed  # fixed | sharegpt: prompt/output lengths (no trace)


class SpecMethod(str, Enum):
    none = "none"
    ngram = "ngram"  # proposals looked up in the prompt and output (runtime/router/spec_decode.py)
    draft = "draft"  # a small draft model of the same tokenizer (runtime/worker/drafter.py)


@dataclass(frozen=True)
class SpecConfig:
    method: SpecMethod = SpecMethod.none  # speculative decoding: none | ngram | draft (greedy output is unchanged)
    num_tokens: int = 4  # k: tokens proposed per row and step, verified in one k+1-token step
    ngram_min: int = 1  # shortest prompt+output suffix looked up for a proposal
    # (3 until 2026-12-06: on SmolLM2's copies 3.78-3.92 output tokens a step at k = 4, at 8 4.02-4.23)
    ngram_max: int = 8  # longest suffix tried first
    max_batch: int = 64  # decode rows above which a step does not speculate (verify CUDA graphs cover max_batch x (num_tokens+1) tokens; scripts/bench_spec.sh c64 measures it)
    chain: bool = True  # ngram: a greedy row's next verify is planned while its verify is out, as if that one kept its proposal and the predicted token after it (off: the row waits for each verdict)
    adaptive: bool = False  # ngram: each row proposes 1 + its recent accepted tokens per verify (an average halved each verify, num_tokens at its start; rounded), at most num_tokens
    draft_model_path: Optional[str] = None  # spec.method=draft: the draft checkpoint folder (the model's tokenizer; llama or qwen2 family)
    draft_ahead: bool = False  # spec.method=draft: each greedy step's next proposals are drafted on the GPU right behind its verdict, while the router plans that step (off: drafted once the plan comes; off until measured on a GPU)


@dataclass(frozen=True)
class LlaunchConfig:
    """The composed Hydra config (conf/config.yaml)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    kernels: KernelSettings = field(default_factory=KernelSettings)
    spec: SpecConfig = field(default_factory=SpecConfig)
    visual: VisualConfig = field(default_factory=VisualConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    bench: Optional[BenchConfig] = None
    device: Device = Device.auto  # auto: cuda when a GPU is visible, else cpu
    # device=cpu: torch threads per worker process; 0: the CPUs the process may use (its affinity and cgroup
    # quota, not the host's core count), shared by the node's worker ranks
    device_threads: int = 0
    dry_run: bool = False  # validate and print the process graph; start nothing
    log_level: LogLevel = LogLevel.INFO  # every process's log


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the graph: what it runs, on which GPUs, which endpoints it binds and dials.

    Endpoint keys are role-local names (see runtime/ipc/endpoints.py); values are ZMQ addresses.
    """

    name: str  # unique: "frontend.0", "router.0", "detokenizer", "worker.0.1" (dp replica . tp rank)
    role: str  # frontend | router | detokenizer | worker | pd_master | config_server
    gpus: List[int] = field(default_factory=list)
    binds: Dict[str, str] = field(default_factory=dict)
    connects: Dict[str, str] = field(default_factory=dict)
    dp_rank: int = 0
    tp_rank: int = 0
    index: int = 0  # frontend worker index
    node: int = 0  # which node runs it (nnodes > 1): each node's launcher starts its own


@dataclass(frozen=True)
class ProcessGraph:
    processes: List[ProcessSpec]
    http_url: str  # where clients connect, e.g. http://127.0.0.1:8000
    ipc_dir: str  # private per-instance directory holding ipc:// sockets
    control: str  # the launcher's PULL endpoint: every process reports ready here
    dist_init: List[str] = field(default_factory=list)  # torch.distributed init address per dp replica


@dataclass(frozen=True)
class RunConfig(LlaunchConfig):
    """The validated config with derived values filled (model architecture, dtype, eos ids,
    batch_max_tokens, concrete device) and the planned graph. Written as YAML to the run directory;
    every child process reads it from there."""

    run_dir: str = ""
    graph: Optional[ProcessGraph] = None
    draft_model: Optional[ModelConfig] = None  # spec.method=draft: the draft checkpoint, resolved like model
