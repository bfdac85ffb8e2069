"""The multimodal part of a config.json (no torch: the launcher reads it): Qwen2-VL's vision tower and
its image token ids, as one plain dict that travels in ModelConfig.vision."""
from __future__ import annotations

from typing import Any, Optional

MULTIMODAL_FAMILIES = ("qwen2_vl",)
_VISION_KEYS = ("depth", "embed_dim", "hidden_size", "num_heads", "mlp_ratio", "patch_size", "spatial_merge_size",
                "temporal_patch_size", "in_channels", "hidden_act")
_TOKEN_KEYS = {"image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653}


def multimodal_fields(top: dict[str, Any]) -> Optional[dict[str, Any]]:
    """config.json's vision tower and image token ids (4.x flat or 5.x nested layout), or None for a
    text-only checkpoint."""
    if top.get("model_type") not in MULTIMODAL_FAMILIES or not isinstance(top.get("vision_config"), dict):
        return None
    v = top["vision_config"]
    rope = v.get("rope_parameters") or {}
    fields = {k: v[k] for k in _VISION_KEYS if k in v}
    fields["rope_theta"] = float(v.get("rope_theta", rope.get("rope_theta", 10000.0)))
    if "hidden_size" not in fields:  # 4.x configs leave it to the language model's width
        fields["hidden_size"] = top.get("hidden_size") or (top.get("text_config") or {}).get("hidden_size")
    for key, default in _TOKEN_KEYS.items():
        fields[key] = int(top.get(key, (top.get("text_config") or {}).get(key, default)))
    return fields
