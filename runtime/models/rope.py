"""Rotary position embedding's scaling as a checkpoint states it (config.json's rope_scaling, or
rope_parameters since transformers 5): which kinds llaunch serves, what each must give, and the context
it stretches the model to. No torch: the launcher's rules and derived values read it. The cos/sin tables
are kernels/reference.py's `rope_cos_sin`, computed as transformers' ROPE_INIT_FUNCTIONS do.
"""
from __future__ import annotations

import numbers
from typing import Any, Optional

# The kinds of scaling served, in transformers' names; "default" (plain RoPE) is stored as no scaling.
ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")
ALIASES = {"su": "longrope"}  # Phi-3's first configs named LongRoPE "su" (vLLM reads it too)
# Keys each kind needs (transformers' validation: the required keys of _validate_<type>_rope_parameters)
REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


def rope_type(scaling: Optional[dict[str, Any]]) -> str:
    """The kind of a rope_scaling dict ("default" for none)."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    return ALIASES.get(kind, kind)


def normalize(scaling: Optional[dict[str, Any]], config: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A config.json's rope scaling in one spelling: `rope_type` set (aliases resolved), rope_theta
    left out, and original_max_position_embeddings where the kind needs it, taken as transformers'
    standardize_rope_params does (a top-level key wins, as Phi-3 writes it; else max_position_embeddings).
    None for plain RoPE."""
    kind = rope_type(scaling)
    if kind in ("default", "mrope"):
        return None
    # partial_rotary_factor (transformers 5 keeps it here) is its own field: checkpoint.py reads it
    out = {k: v for k, v in scaling.items()
           if k not in ("type", "rope_theta", "mrope_section", "partial_rotary_factor") and v is not None}
    out["rope_type"] = kind
    if kind in _NEEDS_ORIGINAL:
        if config.get("original_max_position_embeddings") is not None:
            out["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif config.get("max_position_embeddings") is not None:
            out.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return out


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def rotary_dim(head_dim: Optional[int], partial_rotary_factor: Optional[float]) -> Optional[int]:
    """The dims of a head that rotate: the first head_dim x partial_rotary_factor (transformers' int())."""
    if head_dim is None:
        return None
    return int(head_dim * (partial_rotary_factor or 1.0))


def rope_problems(scaling: Optional[dict[str, Any]], head_dim: Optional[int]) -> list[str]:
    """Why llaunch cannot compute these rotary tables (empty when it can), in the keys' names. head_dim: the
    rotated dims of a head (rotary_dim)."""
    kind = rope_type(scaling)
    if kind == "default":
        return []
    if kind not in ROPE_TYPES:
        return [f"rope_type {kind!r} is not served (served: default, {', '.join(ROPE_TYPES)})"]
    problems = [f"{kind} needs {key}" for key in REQUIRED[kind] if scaling.get(key) is None]
    for key in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if scaling.get(key) is not None and not _number(scaling[key]):
            problems.append(f"{key}={scaling[key]!r} is not a number")
    if _number(scaling.get("factor")) and scaling["factor"] < 1 and kind != "longrope":
        problems.append(f"factor={scaling['factor']} is below 1")
    if kind == "longrope" and head_dim:
        for key in ("short_factor", "long_factor"):
            value = scaling.get(key)
            if value is not None and (not isinstance(value, list) or len(value) != head_dim // 2
                                      or not all(_number(v) for v in value)):
                problems.append(f"{key} must be {head_dim // 2} numbers (the rotated dims / 2)")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={scaling['partial_rotary_factor']} (rotary on part of a head) "
                        "is not served")
    return problems


def context_length(max_position_embeddings: int, scaling: Optional[dict[str, Any]],
                   family: Optional[str] = None) -> int:
    """The longest context the checkpoint is meant to serve: max_position_embeddings, stretched by
    the scaling factor for the kinds whose configs keep the trained length there (linear, dynamic;
    YaRN: original_max_position_embeddings x factor, Qwen2.5's 32,768 x 4 = 131,072), as vLLM derives
    its max_model_len. llama3 and LongRoPE configs already state the stretched length, and so do Gemma 3's
    (131,072 with linear x 8 on its global layers; vLLM leaves gemma3 out too)."""
    if family == "gemma3_text":
        return max_position_embeddings
    kind = rope_type(scaling)
    if kind in ("linear", "dynamic") and _number(scaling.get("factor")):
        return int(max_position_embeddings * scaling["factor"])
    if kind == "yarn" and _number(scaling.get("factor")) and _number(scaling.get("original_max_position_embeddings")):
        return max(max_position_embeddings, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_position_embeddings
