"""The multimodal part of a config.json (no torch: the launcher reads it): Qwen2-VL's (or Qwen2.5-VL's)
vision tower and its image token ids, as one plain dict that travels in ModelConfig.vision.

Qwen2.5-VL's vision_config names the tower's width `hidden_size` and the language model's
`out_hidden_size`; the dict keeps Qwen2-VL's names (embed_dim: the tower, hidden_size: the merger's output)
and adds the 2.5 tower's own keys (intermediate_size, window_size, fullatt_block_indexes)."""
from __future__ import annotations

from typing import Any, Optional

MULTIMODAL_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
_VISION_KEYS = ("depth", "embed_dim", "hidden_size", "num_heads", "mlp_ratio", "patch_size", "spatial_merge_size",
                "temporal_patch_size", "in_channels", "hidden_act")
# Qwen2.5-VL's tower only, with transformers' Qwen2_5_VLVisionConfig defaults for a config.json that omits them
_WINDOWED_DEFAULTS = {"intermediate_size": 3420, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}
_TOKEN_KEYS = {"image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653}


def multimodal_fields(top: dict[str, Any]) -> Optional[dict[str, Any]]:
    """config.json's vision tower and image token ids (4.x flat or 5.x nested layout), or None for a
    text-only checkpoint."""
    if top.get("model_type") not in MULTIMODAL_FAMILIES or not isinstance(top.get("vision_config"), dict):
        return None
    v = top["vision_config"]
    rope = v.get("rope_parameters") or {}
    fields = {k: v[k] for k in _VISION_KEYS if k in v}
    if top["model_type"] == "qwen2_5_vl":
        fields["embed_dim"] = fields.pop("hidden_size")
        if v.get("out_hidden_size") is not None:
            fields["hidden_size"] = v["out_hidden_size"]
        fields["in_channels"] = v.get("in_channels", v.get("in_chans", 3))  # 4.x configs: in_chans
        fields["hidden_act"] = v.get("hidden_act", "silu")
        fields.update({k: v.get(k, default) for k, default in _WINDOWED_DEFAULTS.items()})
        fields["fullatt_block_indexes"] = [int(i) for i in fields["fullatt_block_indexes"]]
    fields["rope_theta"] = float(v.get("rope_theta", rope.get("rope_theta", 10000.0)))
    if "hidden_size" not in fields:  # 4.x configs leave it to the language model's width
        fields["hidden_size"] = top.get("hidden_size") or (top.get("text_config") or {}).get("hidden_size")
    for key, default in _TOKEN_KEYS.items():
        fields[key] = int(top.get(key, (top.get("text_config") or {}).get(key, default)))
    return fields
