"""The architecture of a Llama/Qwen2/Qwen3/Mistral/Gemma 2/Gemma 3/Phi-3 decoder, or of a mixture-of-experts one
(Qwen2-MoE, Qwen3-MoE, Mixtral): every number the model code needs, nothing optional.

The launcher fills `ModelConfig`'s architecture fields from the checkpoint (runtime/models/checkpoint.py)
or a sized profile; `from_model_config` only reads them back. `from_checkpoint` / `from_hf_config` build
it from what checkpoint.py read (tests, tools).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from llaunch.runtime.config import ModelConfig
from llaunch.runtime.models.checkpoint import Checkpoint, parse_hf_config
from llaunch.runtime.models.decoder_variants import GEMMA_FAMILIES, VARIANT_FIELDS, gemma_layer_types
from llaunch.runtime.models.moe_config import MOE_FAMILIES, MOE_FIELDS, is_moe_layer

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "qwen2_vl", "qwen2_5_vl",
            *MOE_FAMILIES)
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_vl", "qwen2_5_vl")  # q/k/v bias whatever config.json says, no o bias
# q/k/v bias by default, never on o: Qwen2 and Qwen2-MoE (whose config.json's qkv_bias may turn it off)
QKV_ONLY_BIAS_FAMILIES = (*QKV_BIAS_FAMILIES, "qwen2_moe")
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text")
FUSED_PROJECTION_FAMILIES = ("phi3",)  # checkpoints hold qkv_proj and gate_up_proj fused

_REQUIRED = ("family", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "max_position_embeddings")
_ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mrope_section", "sliding_window",
                *MOE_FIELDS, *VARIANT_FIELDS)
# Dense models leave the MoE fields unset: no experts
_DENSE = {"num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0, "norm_topk_prob": False,
          "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1, "mlp_only_layers": ()}


@dataclass(frozen=True)
class ModelArch:
    family: str  # llama, mistral (Llama's shape) | qwen2 (+ q/k/v bias) | qwen3 (+ q/k RMSNorm per head) | MoE ones
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (and on o for Llama and Qwen3, as their transformers attention does)
    rope_scaling: Optional[dict[str, Any]] = None
    num_labels: Optional[int] = None  # a score head of this many outputs in place of the LM head (model.task=score)
    score_mlp: bool = False  # the score head is Linear + ReLU + Linear with biases (Qwen2ForRewardModel)
    score_token_ids: tuple[int, ...] = ()  # a yes/no reranker's head: LM-head rows [yes, no] (model.score_head=yes_no)
    embed: bool = False  # an embedding model (model.task=embed): rows return the final norm's hidden state, no head
    mrope_section: Optional[list[int]] = None  # qwen2_vl, qwen2_5_vl: M-RoPE's frequency runs (runtime/models/mrope.py)
    # mixture of experts (runtime/models/moe.py); num_experts 0: a dense model
    num_experts: int = 0  # routed experts of an MoE layer
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: the shared expert's width (0: none)
    decoder_sparse_step: int = 1  # with mlp_only_layers: which layers are MoE (moe_config.is_moe_layer)
    mlp_only_layers: tuple[int, ...] = ()
    # the decoder's variants (runtime/models/decoder_variants.py reads them from config.json)
    sliding_window: Optional[int] = None  # a sliding-window layer's attention window; None: every layer full
    layer_types: Optional[tuple[str, ...]] = None  # sliding_attention | full_attention; None: all windowed if any
    hidden_act: str = "silu"  # gelu_pytorch_tanh: Gemma's GeGLU
    query_pre_attn_scalar: Optional[float] = None  # Gemma: attention scale this ** -0.5; None: head_dim's
    attn_logit_softcapping: Optional[float] = None  # Gemma 2: cap · tanh(score / cap) before the softmax
    final_logit_softcapping: Optional[float] = None  # Gemma 2: cap · tanh(logit / cap)
    rope_local_base_freq: Optional[float] = None  # Gemma 3: sliding layers' plain-RoPE base (rope_theta: global)
    partial_rotary_factor: float = 1.0  # Phi-3 family: rotary on the first head_dim x factor dims

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported ({', '.join(FAMILIES)})")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.family in MOE_FAMILIES and not (
                self.num_experts > 0 and 1 <= self.num_experts_per_tok <= self.num_experts
                and self.moe_intermediate_size > 0 and self.decoder_sparse_step >= 1):
            raise ValueError(f"{self.family}: num_experts={self.num_experts}, num_experts_per_tok="
                             f"{self.num_experts_per_tok}, moe_intermediate_size={self.moe_intermediate_size} and "
                             f"decoder_sparse_step={self.decoder_sparse_step} do not describe a mixture of experts")

    @property
    def o_proj_bias(self) -> bool:
        return self.family not in QKV_ONLY_BIAS_FAMILIES and self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Qwen3, Qwen3-MoE and Gemma 3: q and k go through an RMSNorm over each head (weights [head_dim]) before
        rotary."""
        return self.family in QK_NORM_FAMILIES

    @property
    def gemma(self) -> bool:
        """Gemma 2/3: (1 + w) RMSNorms, a norm after attention and around the MLP, the embedding scaled by
        sqrt(hidden_size)."""
        return self.family in GEMMA_FAMILIES

    @property
    def fused_projections(self) -> bool:
        """Phi-3: the checkpoint holds q‖k‖v as qkv_proj and gate‖up as gate_up_proj."""
        return self.family in FUSED_PROJECTION_FAMILIES

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q/k head that rotate (Phi-4-mini: 96 of 128); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding_layer(self, index: int) -> bool:
        """Layer `index` is a local one: windowed (when sliding_window is set) and, in Gemma 3, on its local rotary."""
        return self.layer_types[index] == "sliding_attention" if self.layer_types is not None else True

    def layer_window(self, index: int) -> int:
        """The attention window of layer `index` in tokens; 0: the whole context."""
        return self.sliding_window if self.sliding_window and self.is_sliding_layer(index) else 0

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` has routed experts (else a dense MLP of intermediate_size)."""
        return is_moe_layer(index, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def expert_params(self) -> int:
        """The routed experts' weights over all layers (most of an MoE model; each token reads top-k of them)."""
        return self.num_moe_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.attention_bias:  # q, k, v biases (and o's for Llama)
            attn += d * (self.num_attention_heads + 2 * self.num_key_value_heads) + (h if self.o_proj_bias else 0)
        layer = attn + (4 if self.gemma else 2) * h + (2 * d if self.qk_norm else 0)
        moe = self.num_moe_layers
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        mlps = (self.num_hidden_layers - moe) * 3 * h * self.intermediate_size + self.expert_params \
            + moe * (self.num_experts * h + shared)  # the router, the shared expert and its gate
        heads = 1 if self.tie_word_embeddings or self.num_labels or self.embed else 2
        score = (self.num_labels or 0) * h + ((h * h + h + self.num_labels) if self.score_mlp else 0)
        return self.num_hidden_layers * layer + mlps + heads * self.vocab_size * h + h + score

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "ModelArch":
        """From a resolved ModelConfig. Fields a config.json may omit take transformers' defaults
        (head_dim = hidden / heads, KV heads = heads, ...); the sizes themselves must be set."""
        missing = [f for f in _REQUIRED if getattr(cfg, f) is None]
        if missing:
            raise ValueError(f"model config is not resolved: {', '.join('model.' + m for m in missing)} "
                             "unset (the launcher fills them from config.json or a sized profile)")
        task, head = getattr(cfg.task, "value", cfg.task), getattr(cfg.score_head, "value", cfg.score_head)
        score = task == "score"
        yes_no = tuple(cfg.score_token_ids or ()) if score and head == "yes_no" else ()
        return cls._with_defaults(cfg.family, cfg.rope_scaling, {f: getattr(cfg, f) for f in _ARCH_FIELDS},
                                  cfg.num_labels if score else None, score and head == "mlp", yes_no, task == "embed")

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "ModelArch":
        """From what checkpoint.py read (config.json or GGUF metadata); refuses features it does not run."""
        if ckpt.unsupported:
            raise ValueError(f"the checkpoint uses {', '.join(ckpt.unsupported)}, which is not supported")
        missing = [f for f in _REQUIRED[1:] if f not in ckpt.arch]
        if missing:
            raise ValueError(f"the checkpoint does not give {', '.join(missing)}")
        return cls._with_defaults(ckpt.family, ckpt.arch.get("rope_scaling"),
                                  {f: ckpt.arch.get(f) for f in _ARCH_FIELDS}, ckpt.arch.get("num_labels"),
                                  ckpt.score_mlp)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelArch":
        """From a Hugging Face config.json dict (tests and tools)."""
        return cls.from_checkpoint(parse_hf_config(hf))

    @classmethod
    def _with_defaults(cls, family: Optional[str], rope_scaling: Optional[dict[str, Any]],
                       fields: dict[str, Any], num_labels: Optional[int] = None,
                       score_mlp: bool = False, score_token_ids: tuple[int, ...] = (),
                       embed: bool = False) -> "ModelArch":
        defaults = {"num_key_value_heads": fields["num_attention_heads"],
                    "head_dim": fields["hidden_size"] // fields["num_attention_heads"],
                    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": family in GEMMA_FAMILIES,
                    "attention_bias": family in QKV_ONLY_BIAS_FAMILIES, "hidden_act": "silu",
                    "partial_rotary_factor": 1.0, **_DENSE}
        if family in GEMMA_FAMILIES:  # a sized profile may leave the interleaving to the family's pattern
            defaults["layer_types"] = gemma_layer_types(family, fields["num_hidden_layers"])
        fields.update({k: v for k, v in defaults.items() if fields[k] is None})
        fields["rope_theta"], fields["rms_norm_eps"] = float(fields["rope_theta"]), float(fields["rms_norm_eps"])
        fields["mlp_only_layers"] = tuple(fields["mlp_only_layers"])
        fields["layer_types"] = tuple(fields["layer_types"]) if fields["layer_types"] is not None else None
        return cls(family=family, rope_scaling=rope_scaling or None, num_labels=num_labels,
                   score_mlp=bool(num_labels) and score_mlp, score_token_ids=score_token_ids, embed=embed, **fields)

    def model_config_fields(self) -> dict[str, Any]:
        """The ModelConfig fields this architecture fills (`dataclasses.replace(cfg, **fields)`)."""
        fields = {"family": self.family, "rope_scaling": self.rope_scaling,
                  **{f: getattr(self, f) for f in _ARCH_FIELDS}}
        if self.num_experts:
            fields["mlp_only_layers"] = list(self.mlp_only_layers)
        else:  # a dense model leaves ModelConfig's MoE fields unset
            fields.update(dict.fromkeys(MOE_FIELDS))
        fields["layer_types"] = list(self.layer_types) if self.layer_types is not None else None
        return fields
