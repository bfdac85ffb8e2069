"""One rank's memory from the config alone (no torch): its share of the weights, the KV bytes of one
token, a step's transient activations. The worker sizes its KV cache from these (worker/kv_sizing.py)
and the launcher's plan reports them and refuses a model whose weights cannot fit (launcher/memory_plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

from llaunch.runtime.config import Device, DType, KvDType, LlaunchConfig, LoadFormat, WeightQuantization
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.checkpoint import read_checkpoint
from llaunch.runtime.models.heads import HeadLayout

GiB = 1 << 30
DTYPE_BYTES = {DType.float32: 4, DType.bfloat16: 2, DType.float16: 2}
GRAPH_POOL_BYTES = 2 * GiB  # CUDA graph pools and the allocator's slack, measured on an H200
# prompt positions one step computes logprobs for (runtime/router/scheduler.py chunks asking prompts)
PROMPT_LOGPROB_TOKENS = 256
MAX_VERIFY_GRAPH_TOKENS = 512  # a larger verify step runs eagerly (its logits alone: 0.3 GB at a 152k vocabulary)


@dataclass(frozen=True)
class RankMemory:
    weights: int  # this rank's share of the parameters (vocabulary-parallel embedding and LM head)
    kv_per_token: int  # K and V of one token over all layers, on this rank
    activations: int  # the peak transient memory of one step (on a GPU, CUDA graph pools included)
    weights_dtype: str = ""  # what the weights are stored in, for the dry run: "bfloat16", "fp8 linears + bfloat16"
    kv_dtype: str = ""  # the KV cache's element type
    experts: int = 0  # of the weights, an MoE model's routed experts (parallel.ep: whole experts; else a slice of each)

    @property
    def before_kv(self) -> int:
        return self.weights + self.activations


def spec_step_tokens(spec, max_rows: int) -> int:
    """The most tokens a speculating step holds, which the worker's verify CUDA graphs cover: every
    row of the largest speculating batch verifying spec.num_tokens proposals, at most
    MAX_VERIFY_GRAPH_TOKENS (0 without speculation)."""
    if getattr(spec.method, "value", spec.method) == "none":
        return 0
    return min(min(spec.max_batch, max_rows) * (spec.num_tokens + 1), MAX_VERIFY_GRAPH_TOKENS)


def mlp_activations(cfg: LlaunchConfig, arch: ModelArch) -> int:
    """Elements one token's MLP holds at once on a rank: a dense layer's gate‖up and product, or an MoE layer's
    router logits and, for each of its k experts, the activated row (a slice of the expert's columns, or whole
    ones under parallel.ep) and the weighted output row, beside the shared expert's."""
    tp = cfg.parallel.tp
    dense = 3 * arch.intermediate_size // tp if arch.num_moe_layers < arch.num_hidden_layers else 0
    if not arch.num_experts:
        return dense
    inter = arch.moe_intermediate_size // (1 if cfg.parallel.ep > 1 else tp)
    moe = (2 * arch.num_experts + arch.num_experts_per_tok * (inter + arch.hidden_size)
           + 3 * arch.shared_expert_intermediate_size // tp)
    return max(dense, moe)


MIXED_GRAPH_MAX_TOKENS = 4096  # model.mixed_graph_tokens=null: router.batch_max_tokens up to this (36 buckets)


def mixed_graph_tokens(cfg: LlaunchConfig) -> int:
    """The longest step the worker replays piecewise graphs for (runtime/worker/mixed_graphs.py); 0: none."""
    if cfg.device == Device.cpu or cfg.model.enforce_eager:
        return 0
    if cfg.model.mixed_graph_tokens is not None:
        return cfg.model.mixed_graph_tokens
    return min(cfg.router.batch_max_tokens or 0, MIXED_GRAPH_MAX_TOKENS)


def activation_bytes(cfg: LlaunchConfig, arch: ModelArch) -> int:
    """Hidden states and MLP intermediates of batch_max_tokens tokens, the float32 logits and sampling
    buffers of the largest batch and of a step's prompt-logprob positions, and the graph pools."""
    per_token = (6 * arch.hidden_size + mlp_activations(cfg, arch)) * 4
    logits = (max(cfg.router.max_running_requests, 1) + PROMPT_LOGPROB_TOKENS) * arch.vocab_size * 4 * 4
    graphs = GRAPH_POOL_BYTES if cfg.device != Device.cpu else 0
    if graphs:  # the verify graphs' own pool: their steps' activations and float32 logits
        graphs += spec_step_tokens(cfg.spec, cfg.router.max_running_requests) * (per_token + arch.vocab_size * 4)
        # the mixed-step graphs' pool (a piece's activations at the largest bucket) and static buffers
        graphs += mixed_graph_tokens(cfg) * per_token
    return (cfg.router.batch_max_tokens or 0) * per_token + logits + graphs


def fp8_weights(cfg: LlaunchConfig) -> bool:
    """The decoder's linear weights are e4m3: model.quantization=fp8 or an fp8 checkpoint."""
    if cfg.model.quantization == WeightQuantization.fp8:
        return True
    ckpt = read_checkpoint(cfg.model.path) if cfg.model.path and cfg.model.load_format != LoadFormat.dummy else None
    return bool(ckpt is not None and ckpt.weight_quant is not None and ckpt.weight_quant.served)


def linear_params(arch: ModelArch) -> int:
    """The decoder layers' q/k/v/o and dense gate/up/down weights (what fp8 quantizes)."""
    h, d = arch.hidden_size, arch.head_dim
    attn = h * d * (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads)
    dense_layers = arch.num_hidden_layers - arch.num_moe_layers
    return arch.num_hidden_layers * attn + dense_layers * 3 * h * arch.intermediate_size


def rank_memory(cfg: LlaunchConfig) -> RankMemory:
    """For a resolved config (dtype concrete, architecture filled)."""
    arch = ModelArch.from_model_config(cfg.model)
    tp = cfg.parallel.tp
    itemsize = DTYPE_BYTES[cfg.model.dtype]
    kv_itemsize = 1 if cfg.cache.kv_dtype == KvDType.fp8_e4m3 else itemsize
    layout = HeadLayout.of(arch.num_attention_heads, arch.num_key_value_heads, tp)
    kv = 2 * arch.num_hidden_layers * layout.kv_heads_per_rank * arch.head_dim * kv_itemsize
    fp8 = fp8_weights(cfg)
    int8 = cfg.model.quantization == WeightQuantization.int8
    one_byte = linear_params(arch) if fp8 or int8 else 0  # (a scale a row besides: under 0.1% of the weights)
    weights = -(-(arch.num_params - one_byte) // tp) * itemsize + -(-one_byte // tp)
    if cfg.model.fp8_lm_head or cfg.model.int8_lm_head:
        # a head of one byte a weight: an own 16-bit weight is freed, a tied embedding keeps its copy
        head = -(-arch.vocab_size // tp) * arch.hidden_size
        weights += head - (0 if arch.tie_word_embeddings else head * itemsize)
    dtype = cfg.model.dtype.value
    weights_dtype = (f"fp8 linears{' and LM head' * cfg.model.fp8_lm_head} + {dtype}" if fp8
                     else f"int8 linears + {dtype}" if int8 else dtype)
    return RankMemory(weights=weights, kv_per_token=kv, activations=activation_bytes(cfg, arch),
                      weights_dtype=weights_dtype + " + int8 LM head" * cfg.model.int8_lm_head,
                      kv_dtype="fp8_e4m3" if kv_itemsize == 1 else dtype,
                      experts=-(-arch.expert_params // tp) * itemsize)
