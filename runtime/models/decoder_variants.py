"""What config.json says about the decoder's per-family variants, in ModelConfig's field names: sliding-window
attention (Mistral's and Phi-3's every layer, Gemma's interleaved local layers), Gemma's attention scale,
soft-capping, GeGLU and Gemma 3's local rotary base, Phi-3's partial rotary. Keys a config.json leaves out take the
defaults of transformers' config classes (Google's Gemma 3 releases write only a few keys of their text config).
No torch: the launcher imports this."""
from __future__ import annotations

from typing import Any, Optional

GEMMA_FAMILIES = ("gemma2", "gemma3_text")
# Families whose transformers attention honours sliding_window (every layer, or Gemma's sliding_attention ones);
# Qwen2's sliding_window is inert unless use_sliding_window, which is refused (checkpoint.py)
WINDOWED_FAMILIES = ("mistral", "mixtral", "phi3", *GEMMA_FAMILIES)
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP activations served (gate·act ⊙ up)
# ModelConfig's (and ModelArch's) fields this module reads, beside sliding_window
VARIANT_FIELDS = ("layer_types", "hidden_act", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_local_base_freq", "partial_rotary_factor")

# transformers' Gemma2Config / Gemma3TextConfig defaults (rotary bases apart: rope_fields)
_GEMMA_DEFAULTS = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
                        sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
                        hidden_activation="gelu_pytorch_tanh"),
}
_GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # every n-th layer global, the others local
_GEMMA_THETA = {"gemma2": (10000.0, None), "gemma3_text": (1_000_000.0, 10000.0)}  # (global, local) defaults
_MISTRAL_WINDOW = 4096  # MistralConfig's default when config.json leaves sliding_window out


def with_family_defaults(family: Optional[str], c: dict[str, Any]) -> dict[str, Any]:
    """The text config `c` with the keys it leaves out filled by its family's config class (Gemma's)."""
    return {**_GEMMA_DEFAULTS[family], **c} if family in _GEMMA_DEFAULTS else c


def gemma_layer_types(family: str, num_layers: int, pattern: Optional[int] = None) -> list[str]:
    """Gemma's interleaving when config.json gives no layer_types: layer i global when (i + 1) % pattern == 0
    (Gemma 2: every other layer; Gemma 3: sliding_window_pattern, 6 by default)."""
    pattern = pattern or _GEMMA_PATTERN[family]
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def split_rope_parameters(family: Optional[str], c: dict[str, Any]) -> tuple[dict, Optional[float], list[str]]:
    """(the rope parameters of the global layers, Gemma 3's local layers' rotary base, what is not served).
    transformers 5 writes Gemma 3's per layer type ({full_attention: {...}, sliding_attention: {...}}); 4.x writes
    rope_theta / rope_scaling (global) and rope_local_base_freq (local)."""
    rope_parameters = c.get("rope_parameters") or {}
    local: Optional[dict] = None
    unsupported = []
    if any(t in rope_parameters for t in LAYER_TYPES):
        local = rope_parameters.get("sliding_attention") or {}
        rope_parameters = rope_parameters.get("full_attention") or {}
    if family == "gemma3_text":
        local = local or {}
        if (local.get("rope_type") or "default") != "default":
            unsupported.append(f"rope_parameters.sliding_attention rope_type {local['rope_type']!r} (Gemma 3's local "
                               "layers are served with plain RoPE)")
        base = local.get("rope_theta", c.get("rope_local_base_freq", _GEMMA_THETA[family][1]))
        return rope_parameters, float(base), unsupported
    if local is not None:
        unsupported.append("rope_parameters per layer type (Gemma 3's only)")
    return rope_parameters, None, unsupported


def default_rope_theta(family: Optional[str]) -> Optional[float]:
    return _GEMMA_THETA[family][0] if family in _GEMMA_THETA else None


def variant_fields(family: Optional[str], c: dict[str, Any], partial_rotary: float) -> tuple[dict[str, Any], list[str]]:
    """(the variant fields of text config `c` (after with_family_defaults), what in it is not served)."""
    unsupported = []
    gemma = family in GEMMA_FAMILIES
    window = None
    if family in WINDOWED_FAMILIES:
        window = c.get("sliding_window", _MISTRAL_WINDOW if family == "mistral" else None)
    layer_types = c.get("layer_types")
    if gemma:
        if layer_types is None:
            layer_types = gemma_layer_types(family, c["num_hidden_layers"], c.get("sliding_window_pattern"))
        if len(layer_types) != c["num_hidden_layers"] or any(t not in LAYER_TYPES for t in layer_types):
            unsupported.append(f"layer_types={layer_types!r} (one of {', '.join(LAYER_TYPES)} per layer)")
            layer_types = None  # refused by the line above, not again by model.layer_types' rule
        if c.get("use_bidirectional_attention"):
            unsupported.append("use_bidirectional_attention=true (an embedding model's bidirectional attention)")
    else:
        if "sliding_attention" in (layer_types or []) and family not in WINDOWED_FAMILIES:
            unsupported.append("sliding_attention layers (layer_types)")
        layer_types = None  # Mistral, Mixtral, Phi-3: transformers windows every layer, whatever layer_types says
    # Gemma reads hidden_activation (null in some configs: its gelu_pytorch_tanh); the others hidden_act
    if gemma:
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    else:
        act = c.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        key = "hidden_activation" if gemma else "hidden_act"
        unsupported.append(f"{key}={act!r} (served: {', '.join(ACTIVATIONS)})")
    if partial_rotary != 1.0 and family != "phi3":  # Phi-3's transformers code is the one that honours it
        unsupported.append(f"partial_rotary_factor={partial_rotary} (rotary on part of each head: the phi3 family's)")
    fields = {
        "sliding_window": window,
        "layer_types": list(layer_types) if layer_types is not None else None,  # Gemma 3's local rotary reads them too
        "hidden_act": act if act in ACTIVATIONS and act != "silu" else None,  # an unserved one: refused above
        "query_pre_attn_scalar": c.get("query_pre_attn_scalar") if gemma else None,
        # transformers' Gemma 3 attention never applies attn_logit_softcapping (Gemma 2's does)
        "attn_logit_softcapping": c.get("attn_logit_softcapping") if family == "gemma2" else None,
        "final_logit_softcapping": c.get("final_logit_softcapping") if gemma else None,
        "partial_rotary_factor": partial_rotary if family == "phi3" and partial_rotary != 1.0 else None,
    }
    return {k: v for k, v in fields.items() if v is not None}, unsupported
