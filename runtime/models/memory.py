"""One rank's memory from the config alone (no torch): its share of the weights, the KV bytes of one
token, a step's transient activations. The worker sizes its KV cache from these (worker/kv_sizing.py)
and the launcher's plan reports them and refuses a model whose weights cannot fit (launcher/memory_plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

from llaunch.runtime.config import Device, DType, LlaunchConfig
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.heads import HeadLayout

GiB = 1 << 30
DTYPE_BYTES = {DType.float32: 4, DType.bfloat16: 2, DType.float16: 2}
GRAPH_POOL_BYTES = 2 * GiB  # CUDA graph pools and the allocator's slack, measured on an H200
# prompt positions one step computes logprobs for (runtime/router/scheduler.py chunks asking prompts)
PROMPT_LOGPROB_TOKENS = 256


@dataclass(frozen=True)
class RankMemory:
    weights: int  # this rank's share of the parameters (vocabulary-parallel embedding and LM head)
    kv_per_token: int  # K and V of one token over all layers, on this rank
    activations: int  # the peak transient memory of one step (on a GPU, CUDA graph pools included)

    @property
    def before_kv(self) -> int:
        return self.weights + self.activations


def activation_bytes(cfg: LlaunchConfig, arch: ModelArch) -> int:
    """Hidden states and MLP intermediates of batch_max_tokens tokens, the float32 logits and sampling
    buffers of the largest batch and of a step's prompt-logprob positions, and the graph pools."""
    per_token = (6 * arch.hidden_size + 3 * arch.intermediate_size // cfg.parallel.tp) * 4
    logits = (max(cfg.router.max_running_requests, 1) + PROMPT_LOGPROB_TOKENS) * arch.vocab_size * 4 * 4
    graphs = GRAPH_POOL_BYTES if cfg.device != Device.cpu else 0
    return (cfg.router.batch_max_tokens or 0) * per_token + logits + graphs


def rank_memory(cfg: LlaunchConfig) -> RankMemory:
    """For a resolved config (dtype concrete, architecture filled)."""
    arch = ModelArch.from_model_config(cfg.model)
    tp = cfg.parallel.tp
    itemsize = DTYPE_BYTES[cfg.model.dtype]
    layout = HeadLayout.of(arch.num_attention_heads, arch.num_key_value_heads, tp)
    kv = 2 * arch.num_hidden_layers * layout.kv_heads_per_rank * arch.head_dim * itemsize
    return RankMemory(weights=-(-arch.num_params // tp) * itemsize, kv_per_token=kv,
                      activations=activation_bytes(cfg, arch))
