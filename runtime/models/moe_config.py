"""What config.json says about a mixture-of-experts decoder (Qwen2-MoE, Qwen3-MoE, Mixtral), in ModelConfig's
field names; keys a config.json leaves out take the defaults of transformers' config classes. No torch: the
launcher imports this."""
from __future__ import annotations

from typing import Any, Optional

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers")

# transformers' Qwen2MoeConfig / Qwen3MoeConfig defaults (Qwen1.5-MoE-A2.7B's and Qwen3-30B-A3B's experts)
_QWEN_DEFAULTS = {
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "norm_topk_prob": False,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "shared_expert_intermediate_size": 0},
}


def moe_fields(family: Optional[str], c: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of config.json `c` (a text config); {} for a dense family."""
    if family == "mixtral":  # every layer MoE, no shared expert, weights always renormalized (its router)
        return {"num_experts": c.get("num_local_experts", 8), "num_experts_per_tok": c.get("num_experts_per_tok", 2),
                "moe_intermediate_size": c.get("intermediate_size"), "norm_topk_prob": True,
                "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if family not in _QWEN_DEFAULTS:
        return {}
    defaults = _QWEN_DEFAULTS[family]
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map), Qwen's releases num_experts
    experts = c.get("num_experts", c.get("num_local_experts", defaults["num_experts"]))
    fields = {k: c.get(k, v) for k, v in defaults.items()} | {"num_experts": experts}
    return fields | {"decoder_sparse_step": c.get("decoder_sparse_step", 1),
                     "mlp_only_layers": list(c.get("mlp_only_layers") or [])}


def is_moe_layer(index: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers) -> bool:
    """transformers' rule (Qwen2MoeDecoderLayer): layer `index` has the sparse MoE block, else a dense MLP."""
    return num_experts > 0 and index not in mlp_only_layers and (index + 1) % decoder_sparse_step == 0
