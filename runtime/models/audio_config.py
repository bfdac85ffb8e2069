"""The audio part of a config.json (no torch: the launcher reads it): Qwen2-Audio's Whisper-style audio
encoder, its projector's output width and the audio token id, as one plain dict that travels in
ModelConfig.audio."""
from __future__ import annotations

from typing import Any, Optional

AUDIO_FAMILIES = ("qwen2_audio",)
_ENCODER_KEYS = ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "num_mel_bins",
                 "max_source_positions", "activation_function")


def audio_fields(top: dict[str, Any]) -> Optional[dict[str, Any]]:
    """config.json's audio encoder and audio token id (`audio_token_index` of 4.x, `audio_token_id` of
    5.x; the language model flat or nested in `text_config`), or None for a checkpoint without audio."""
    if top.get("model_type") not in AUDIO_FAMILIES or not isinstance(top.get("audio_config"), dict):
        return None
    a, text = top["audio_config"], top.get("text_config") or top
    fields = {k: a[k] for k in _ENCODER_KEYS if k in a}
    fields["hidden_size"] = int(text.get("hidden_size") or top.get("hidden_size"))  # the projector's output
    fields["audio_token_id"] = int(top.get("audio_token_index", top.get("audio_token_id", 151646)))
    return fields
